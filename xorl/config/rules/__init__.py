"""The config rules by section, each a function returning a list of problems; xorl/config/validate.py's
validate_config calls them in order and raises them as one ConfigError. Nothing is imported here, so
importing one rule file loads only what it needs."""
