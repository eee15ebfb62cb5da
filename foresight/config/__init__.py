"""Recipes: typed settings read from YAML, their checks, and the values recipes spell in strings."""
