"""Integrations with other frameworks; each is an optional dependency, imported on demand
(`import torchbridge.integrations.lightning`)."""
