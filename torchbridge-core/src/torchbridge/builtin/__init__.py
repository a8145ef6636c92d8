"""The built-in plugins: written and loaded like any vendor plugin, never imported by the
core (the plugin host loads them by module path)."""
