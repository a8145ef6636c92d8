"""The built-in CPU backend plugin: host.py probes the host, config.py is its section,
passes.py its passes, plugin.py its hooks."""
