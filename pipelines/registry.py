"""The pipelines the CLI knows, their typed parameters, and parsing of ``key=value`` strings."""
import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from kfp_pytorch.components.errors import ConfigError

from . import train_and_serve as _tas

_KFP_TYPES = {"STRING": str, "NUMBER_INTEGER": int, "NUMBER_DOUBLE": float, "BOOLEAN": bool}
_TYPE_NAMES = {str: "string", int: "integer", float: "finite number", bool: "boolean"}


@dataclass(frozen=True)
class Param:
    name: str
    type: type
    default: Any
    description: str = ""


@dataclass(frozen=True)
class PipelineEntry:
    name: str
    func: Any
    """The ``@dsl.pipeline`` object."""
    validate: Callable[[dict], list[str]]
    """Every problem with a full parameter set, each starting with the parameter's name."""
    summary: str
    build: Callable | None = None
    """Builds the pipeline with Kubernetes platform settings (``build(platform)``), if supported."""
    inert: Callable[[set, dict], list[str]] | None = None
    """Notes on given parameters the run will not read (``inert(given names, resolved values)``)."""

    def inert_notes(self, raw: dict, values: dict) -> list[str]:
        return self.inert(set(raw), values) if self.inert else []

    @property
    def params(self) -> list[Param]:
        import inspect

        spec = self.func.pipeline_spec.root.input_definitions.parameters
        order = list(inspect.signature(self.func.pipeline_func).parameters)
        docs = getattr(self.func.pipeline_func, "param_docs", {})
        out = []
        for name in order:
            p = spec[name]
            from kfp.pipeline_spec import pipeline_spec_pb2 as pb

            tname = pb.ParameterType.ParameterTypeEnum.Name(p.parameter_type)
            typ = _KFP_TYPES.get(tname, str)
            default = None
            if p.HasField("default_value"):
                from google.protobuf.json_format import MessageToDict

                default = MessageToDict(p.default_value)
                default = typ(default) if default is not None else None
            out.append(Param(name, typ, default, docs.get(name, "")))
        return out

    def resolve(self, raw: dict[str, str | Any]) -> dict:
        """Defaults + parsed ``raw`` values, type-checked and validated, all problems at once."""
        params = {p.name: p for p in self.params}
        problems, values = [], {p.name: p.default for p in params.values()}
        for key, value in raw.items():
            if key not in params:
                near = difflib.get_close_matches(key, params, n=1)
                problems.append(f"{key}: unknown parameter" + (f"; did you mean {near[0]!r}?" if near else
                                                               f"; known: {', '.join(params)}"))
                continue
            try:
                values[key] = parse_value(value, params[key].type)
            except ValueError:
                problems.append(f"{key}: expected {_TYPE_NAMES[params[key].type]}, got {value!r}")
        # the defaults stand in for values that did not parse: no word on a check that would read them
        unread = re.compile("|".join(rf"\b{re.escape(p.partition(':')[0])}\b" for p in problems) or "(?!)")
        problems += [p for p in self.validate(values) if not unread.search(p)]
        if problems:
            raise ConfigError(problems, f"run `kfp-pytorch pipelines` to see {self.name}'s parameters",
                              title=f"invalid parameters for pipeline {self.name}")
        return values


def parse_value(value: Any, typ: type) -> Any:
    if typ is float:  # KFP carries parameters as protobuf Values, which have no inf or NaN
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(value)
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(value)
        return number
    if not isinstance(value, str):
        if isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
            return value
        raise ValueError(value)
    if typ is bool:
        low = value.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ValueError(value)
    return typ(value)


PIPELINES: dict[str, PipelineEntry] = {
    "train_and_serve": PipelineEntry("train_and_serve", _tas.train_and_serve, _tas.validate_params,
                                     "prepare -> train (DDP / PyTorchJob) -> evaluate -> register -> serve",
                                     _tas.build, _tas.inert_params),
}


def get_pipeline(name: str) -> PipelineEntry:
    key = name.replace("-", "_")
    if key not in PIPELINES:
        near = difflib.get_close_matches(key, PIPELINES, n=1)
        raise ConfigError([f"unknown pipeline {name!r}" + (f"; did you mean {near[0]!r}?" if near else "")],
                          f"available pipelines: {', '.join(PIPELINES)} (kfp-pytorch pipelines)",
                          title="unknown pipeline")
    return PIPELINES[key]
