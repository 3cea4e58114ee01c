"""The run config: its sections, reading it, and the rules it must satisfy before anything starts.

- ``sections.py``: ``Config`` and its ``model:`` / ``data:`` / ``train:`` dataclasses (each field once), ``set_field``;
  ``compute_dtype``.
- ``load.py``: ``load_config(path, overrides)``: YAML plus ``--section.key=value`` overrides.
- ``validate.py``: ``validate_config(config, world_size)``, which runs every rule in ``rules/`` (by
  section) and raises one ``ConfigError`` (``errors.py``) naming each field and its fix.
- ``model_path.py``: ``model.model_path``, a Hugging Face folder whose config.json defines the model.
- ``field_types.py``: a field's type, and coercing a YAML / CLI value to it.
"""

from xorl._lazy import lazy_getattr

_EXPORTS = {
    "Config": ".sections",
    "ModelConfig": ".sections",
    "DataConfig": ".sections",
    "TrainConfig": ".sections",
    "SECTIONS": ".sections",
    "compute_dtype": ".sections",
    "config_help": ".sections",
    "field_docs": ".sections",
    "load_config": ".load",
    "parse_overrides": ".load",
    "validate_config": ".validate",
    "ConfigError": ".errors",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
