"""prepare_model's pass pipeline: passes from the core and plugins, one honest report."""
