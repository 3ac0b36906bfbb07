"""Recipes: programs that build a model by training it (a warm start), above the pipeline whose tasks they use."""
