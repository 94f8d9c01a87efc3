"""Built-in example environments for multi-turn tasks (``TaskConfig.environment``):
small ``asyncrl.episodes.env.Environment`` subclasses, with writers for the data files
their experiments train and evaluate on."""
