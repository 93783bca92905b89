from hybridlm.config.errors import ConfigError
from hybridlm.config.structured import build_dataclass, to_dict

__all__ = ["ConfigError", "build_dataclass", "to_dict"]
