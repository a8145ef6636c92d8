raise ImportError("broken_import: this plugin cannot load (deliberately, for the tests)")
