"""A randomly initialised causal LM from a config spec: a model type with overrides, or a Hub id / directory.

``scripts/train.py --random-init SPEC`` builds its model here. A spec is a transformers model type
(``llama``) or a Hub id / directory whose config is used, with ``key=value`` overrides after a
colon; each value is read as JSON when it can be:

>>> parse_config_spec("llama:hidden_size=512,num_hidden_layers=4,rope_scaling=null")
('llama', {'hidden_size': 512, 'num_hidden_layers': 4, 'rope_scaling': None})

An override the config does not know, of another kind than the config's default, or a size below 1
is refused before anything is built, naming the setting; so is a config the model cannot be built
from. Messages start with the spec. transformers is imported when a model is built.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

import torch

# The kinds an override must have, by the kind of the config's default, and how a message names each.
_KINDS = ((bool, "true or false"), (int, "an integer"), (float, "a number"), (str, "a string"))
# Model types a message names when none is close to a name that is no model type.
_COMMON_TYPES = "llama, mistral, qwen2, qwen3, gemma2, gpt2"


class ConfigSpecError(ValueError):
    """A config spec that names no buildable model: its message starts with the spec."""


def parse_config_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"llama:hidden_size=512,num_hidden_layers=4"`` -> ("llama", {...}); a ConfigSpecError for an item without ``=``."""
    name, _, overrides = spec.partition(":")
    values: dict[str, Any] = {}
    for item in filter(None, overrides.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigSpecError(f"{spec!r}: {item!r} is not key=value")
        try:
            values[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            values[key.strip()] = raw
    return name, values


def check_config_overrides(spec: str, defaults: Any, overrides: dict[str, Any]) -> None:
    """Refuse an override the config ``defaults`` does not know (``num_hiden_layers``), whose value is not of the kind
    of the config's default (``hidden_size=abc``), or a size or count below 1 (``hidden_size=-16``)."""
    _check_known(spec, defaults, overrides)
    for key, value in overrides.items():
        default = getattr(defaults, key, None)
        _check_positive(spec, key, default, value)
        _check_kind(spec, key, default, value)


def _check_known(spec: str, defaults: Any, overrides: dict[str, Any]) -> None:
    """ConfigSpecError naming the first override that is no setting of the config, with the closest one and the list."""
    from transformers import PretrainedConfig

    known = sorted(defaults.to_dict())
    own = [key for key in known if key not in PretrainedConfig().to_dict()] or known  # listed without the generic ones
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigSpecError(f"{spec}: {key} is not a setting of the {defaults.model_type} config{hint}; its settings: "
                             f"{', '.join(own)}")


def _check_positive(spec: str, key: str, default: Any, value: Any) -> None:
    """A size or count (``*_size``, ``num_*``) whose default is an integer must be a positive integer."""
    sized = key.startswith("num_") or key.endswith("_size")
    if sized and isinstance(default, int) and _is_int(value) and value < 1:
        raise ConfigSpecError(f"{spec}: {key}={value} must be a positive integer")


def _check_kind(spec: str, key: str, default: Any, value: Any) -> None:
    """The value must be of the kind of the config's default (an int where a float is expected, too)."""
    for kind, described in _KINDS:
        if isinstance(default, kind):
            accepted = (int, float) if kind is float else kind
            if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
                raise ConfigSpecError(f"{spec}: {key}={value!r} must be {described} (the config's default is {default!r})")
            return


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def random_init_model(spec: str, vocab_size: int, attn_implementation: str, seed: int,
                      dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The causal LM of ``spec``, its weights in ``dtype`` (built in it, so RoPE's frequencies stay float32 as in
    a loaded checkpoint), initialised from ``seed``; a model type gets the shards' ``vocab_size`` unless the spec
    sets one. A ConfigSpecError when it cannot be built."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    name, overrides = parse_config_spec(spec)
    model_type = name in CONFIG_MAPPING
    defaults = CONFIG_MAPPING[name]() if model_type else _named_config(spec, name)
    check_config_overrides(spec, defaults, overrides)
    torch.manual_seed(seed)
    try:
        if model_type:
            config = AutoConfig.for_model(name, **{"vocab_size": vocab_size, **overrides})
        else:
            config = AutoConfig.from_pretrained(name, **overrides)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    except (StrictDataclassError, RuntimeError) as err:  # the config's own checks, or a size torch refuses
        reason = [line.strip() for line in str(err).splitlines() if line.strip()][-1:] or [type(err).__name__]
        raise ConfigSpecError(f"{spec}: no model can be built from it ({reason[0]})") from None


def _named_config(spec: str, name: str) -> Any:
    """The config of the directory or Hub id ``name``; a ConfigSpecError naming the model types close to it when
    there is none (offline, transformers only says it could not connect to the Hub)."""
    from huggingface_hub import constants
    from transformers import CONFIG_MAPPING, AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except OSError as err:
        close = difflib.get_close_matches(name, list(CONFIG_MAPPING), n=3)
        hint = f"close model types: {', '.join(close)}" if close else f"no model type is close to it (such as {_COMMON_TYPES})"
        if constants.HF_HUB_OFFLINE:
            found = "a local directory or a Hub id found offline (HF_HUB_OFFLINE=1)"
        else:
            found = f"a local directory or a Hub id whose config could be read ({str(err).strip().splitlines()[0]})"
        raise ConfigSpecError(f"{spec}: {name} is neither a transformers model type nor {found}; {hint}") from None
