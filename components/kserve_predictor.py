"""The KServe predictor: one ``kserve.Model`` class for local serving and InferenceServices.

Run as the container's entrypoint (a KServe custom predictor), with KServe's own arguments::

    python -m kfp_pytorch.components.kserve_predictor --model_name digits --model_uri s3://models/run/model

It speaks the Open Inference Protocol v2 through KServe's ``ModelServer``:
``/v2/health/ready``, ``/v2/models/{name}/ready``, ``POST /v2/models/{name}/infer`` and the model's
metadata, ``GET /v2/models/{name}``, which declares its inputs by feature name (one FP32 ``[-1]``
column each), so a client that holds a table but not the model's directory sends its columns by
name (``kfp-pytorch serve predict --url``).
Request: one FP32 input ``[n, features]`` of raw features (for a model trained on an image's pixels,
images ``[n, C, H, W]`` or ``[n, H, W]`` too), or one input ``[n]`` per feature column,
named by it (the columnar form of KServe's tabular servers, flagged ``parameters: {"content_type":
"pd"}``: matched by name, in any order, other columns ignored); v1: ``instances`` as rows, or as
records ``{"column": value, ...}``, read by name. Response: ``probabilities`` FP32
``[n, classes]``, ``label`` INT64 ``[n]`` and, for a model trained on a text label column, ``class``
BYTES ``[n]`` (the class names; the v1 protocol's ``predictions`` are then names too), and the
model's content fingerprint as ``model_version``. A request that names ``outputs`` gets those only.
Inputs and outputs may be binary tensors (the protocol's binary tensor extension, as Triton reads
it): ``binary_data_output`` asks for every output as raw bytes after the JSON header, a named
output's ``parameters.binary_data`` for that one.
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid
import warnings

import kserve
import numpy as np
from kserve import InferInput, InferOutput, InferRequest, InferResponse
from kserve.constants.constants import INFERENCE_CONTENT_LENGTH_HEADER
from kserve.errors import InvalidInput
from kserve.protocol.dataplane import DataPlane
from kserve.protocol.infer_type import RequestedOutput

from .errors import KfpPytorchError
from .exported_model import lacking
from .predictor import ModelRunner, names_of
from .serve import WAITING_FOR_PORT, port_is_free


class TorchPredictor(kserve.Model):
    def __init__(self, name: str, model_uri: str):
        super().__init__(name)
        self.model_uri = model_uri
        self.runner: ModelRunner | None = None
        self.ready = False

    def load(self) -> bool:
        self.runner = ModelRunner(self.model_uri)
        self.ready = True
        return self.ready

    def get_input_types(self) -> list[dict]:
        """The v2 metadata's inputs: one FP32 column ``[-1]`` per feature, named by it (the
        columnar form a table is sent in); ``[-1, features]`` when the model has no names."""
        features = self.runner.meta.get("features")
        if features:
            return [{"name": f, "datatype": "FP32", "shape": [-1]} for f in features]
        return [{"name": "input-0", "datatype": "FP32", "shape": [-1, self.runner.num_features]}]

    def get_output_types(self) -> list[dict]:
        outputs = [{"name": "probabilities", "datatype": "FP32", "shape": [-1, self.runner.num_classes]},
                   {"name": "label", "datatype": "INT64", "shape": [-1]}]
        if self.runner.class_names is not None:
            outputs.append({"name": "class", "datatype": "BYTES", "shape": [-1]})
        return outputs

    def predict(self, payload, headers=None, response_headers=None):
        rows = _rows(payload, self.runner.meta.get("features"))
        request_id = payload.id if isinstance(payload, InferRequest) else None
        try:
            probs, labels = self.runner.predict(rows)
        except ValueError as e:
            raise InvalidInput(str(e))
        names = names_of(labels, self.runner.class_names)
        if not isinstance(payload, InferRequest):
            return {"predictions": names if names is not None else labels.tolist()}
        # each output's data as an array: KServe's to_rest encodes it once, as JSON or binary (an
        # output given as a list it reads back into an array and encodes again)
        outputs = [InferOutput("probabilities", list(probs.shape), "FP32", data=probs.astype(np.float32, copy=False)),
                   InferOutput("label", list(labels.shape), "INT64", data=labels)]
        if names is not None:  # a model of named classes also answers with the names
            outputs.append(InferOutput("class", [len(names)], "BYTES", data=np.asarray(names, dtype=np.object_)))
        chosen = _requested(payload, outputs)
        # model_version: the model's content fingerprint, so a client reading a table in batches
        # sees when another model answers (a local redeploy on the same URL, a KServe canary)
        return InferResponse(model_name=self.name, model_version=self.runner.fingerprint, infer_outputs=chosen,
                             response_id=request_id or str(uuid.uuid4()),
                             requested_outputs=[RequestedOutput(o.name, {"binary_data": b})
                                                for o, b in zip(chosen, _binary(payload, chosen))])


def _requested(payload: InferRequest, outputs: list[InferOutput]) -> list[InferOutput]:
    """The outputs the request names (OIP v2: all of them when it names none), in its order."""
    wanted = [o.name for o in payload.request_outputs or []]
    if not wanted:
        return outputs
    by_name = {o.name: o for o in outputs}
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        raise InvalidInput(f"outputs {unknown} are not outputs of this model (it has {list(by_name)})")
    return [by_name[w] for w in wanted]


def _binary(payload: InferRequest, chosen: list[InferOutput]) -> list[bool]:
    """Which outputs are answered as raw bytes after the JSON header (the protocol's binary tensor
    extension, as Triton reads it): an output the request names with ``parameters.binary_data``
    as it says, every other one as the request's ``binary_data_output`` says. (KServe 0.21's
    to_rest reads a named output without ``binary_data`` as JSON, whatever ``binary_data_output``
    says: each output's choice is made here and handed to it.)"""
    default = bool(payload.use_binary_outputs)
    asked = {o.name: o.binary_data for o in payload.request_outputs or []}
    for name, flag in asked.items():
        if flag is not None and not isinstance(flag, bool):
            raise InvalidInput(f"output {name!r}: parameters.binary_data is true or false, not {flag!r}")
    return [default if asked.get(o.name) is None else asked[o.name] for o in chosen]


_NUMERIC = {"FP16", "FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}


def _columns(inputs, features: list[str]) -> np.ndarray:
    """Rows from one input per feature column (``[n]`` or ``[n, 1]``), by name, in training order."""
    by_name = {i.name: i for i in inputs}
    if missing := lacking(features, by_name):
        known = set(features)
        unknown = [name for name in by_name if name not in known]
        raise InvalidInput(f"the request has one input per column, but lacks {missing}"
                           + (f"; inputs the model does not take: {unknown[:8]}" if unknown else ""))
    cols = []
    for f in features:
        inp = by_name[f]
        if inp.datatype not in _NUMERIC and inp.datatype != "BOOL":  # a boolean column is trained on as 1/0
            raise InvalidInput(f"input {f!r}: datatype {inp.datatype} is not supported; a feature column is numeric "
                               "(or BOOL)")
        try:
            col = inp.as_numpy().astype(np.float32)
        except (ValueError, TypeError, OverflowError) as e:
            raise InvalidInput(f"input {f!r}: its data do not fill shape {list(inp.shape)} ({e})")
        if col.ndim == 2 and col.shape[1] == 1:
            col = col[:, 0]
        if col.ndim != 1 or (cols and len(col) != len(cols[0])):
            raise InvalidInput(f"input {f!r}: a column is of shape [n] (every column the same n), got {list(col.shape)}"
                               + (f", while {features[0]!r} has {len(cols[0])} rows" if cols and col.ndim == 1 else ""))
        cols.append(col)
    return np.stack(cols, axis=1)


def _content_type(payload: InferRequest) -> str:
    """The request's ``content_type`` parameter (v2 HTTP: a string; gRPC: an InferParameter)."""
    value = (payload.parameters or {}).get("content_type", "")
    return str(getattr(value, "string_param", value))


def _rows(payload, features: list[str] | None = None) -> np.ndarray:
    """The request's feature rows; a malformed request is InvalidInput (HTTP 400), never a 500."""
    if isinstance(payload, InferRequest):
        inputs = payload.inputs or []
        # one input per column: flagged as a DataFrame (KServe's "pd" content type), or several
        # inputs, or one named by the model's only feature
        if features and (_content_type(payload) == "pd" or (any(i.name in features for i in inputs) and (
                len(inputs) > 1 or (len(features) == 1 and len(inputs[0].shape) == 1)))):
            return _columns(inputs, features)
        if len(inputs) != 1:
            raise InvalidInput(f"the model takes one input, FP32 raw features of shape [n, features] (or one "
                               f"input per feature column, named by it); the request "
                               f"has {len(payload.inputs or [])}{': ' if payload.inputs else ''}"
                               f"{', '.join(repr(i.name) for i in payload.inputs or [])}")
        inp = payload.inputs[0]
        if inp.datatype not in _NUMERIC:
            raise InvalidInput(f"input {inp.name!r}: datatype {inp.datatype} is not supported; "
                               "send FP32 raw features of shape [n, features]")
        try:
            return inp.as_numpy()
        except (ValueError, TypeError, OverflowError) as e:
            raise InvalidInput(f"input {inp.name!r}: its data do not fill shape {list(inp.shape)} ({e})")
    if not isinstance(payload, dict):
        raise InvalidInput("expected an Open Inference Protocol v2 request or a v1 {\"instances\": [...]} body")
    if not isinstance(payload.get("instances"), list):
        raise InvalidInput("a v1 request is {\"instances\": [[features...], ...]}: rows of raw features")
    instances = payload["instances"]
    if instances and features and all(isinstance(r, dict) for r in instances):  # records, by column name
        if missing := lacking(features, set.intersection(*(set(r) for r in instances))):
            raise InvalidInput(f"instances: records lack {missing}")
        instances = [[r[f] for f in features] for r in instances]
    try:  # v1 protocol: {"instances": [[...], ...]}
        return np.asarray(instances, dtype=np.float32)
    except (ValueError, TypeError, OverflowError) as e:
        raise InvalidInput(f"instances: must be rows of numbers of equal length ({e})")


def _wait_for_port(host: str, port: int, timeout: float) -> bool:
    """Wait, model loaded, until ``port`` can be bound on ``host`` as uvicorn binds it
    (SO_REUSEADDR), so a redeploy's gap is the server's start, not the model's load. The line
    printed first tells the deployer the model is loaded (serve.LocalServeBackend reads it)."""
    import time

    print(f"{WAITING_FOR_PORT} {port}", flush=True)
    deadline = time.monotonic() + timeout
    while not port_is_free(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _RawDataPlane(DataPlane):
    """KServe's DataPlane, binary tensors of a request kept as bytes.

    KServe (0.21) reads a binary input, and then turns it into a Python list one ``.item()`` at a
    time (``InferRequest.from_bytes``): 340 ms of a 4096-row, 64-feature batch that the model
    scores in 8, so binary rows cost the server more than JSON ones. Here the bytes stay as they
    came, as KServe's gRPC path keeps them (``raw_inputs``), and ``as_numpy`` reads them with
    ``np.frombuffer``. A malformed request is a 400 that says what is wrong (KServe's reading
    answered sizes that do not add up with a 500). A request that mixes JSON data into a binary
    one is left to KServe's reading."""

    def decode_inference_request(self, body, headers, model_name):
        import orjson

        given = headers.get(INFERENCE_CONTENT_LENGTH_HEADER) if isinstance(body, bytes) else None
        if given is None:
            return super().decode_inference_request(body, headers, model_name)
        if not str(given).isdigit() or int(given) > len(body):
            raise InvalidInput(f"Inference-Header-Content-Length: {given!r} is not the length in bytes of the "
                               f"request's JSON header (the body has {len(body)} bytes)")
        head_len = int(given)
        try:
            head = orjson.loads(body[:head_len])
        except orjson.JSONDecodeError as e:
            raise InvalidInput(f"the request's JSON header (its first {head_len} bytes) does not parse: {e}")
        inputs = head.get("inputs") if isinstance(head, dict) else None
        if not isinstance(inputs, list) or not all(
                isinstance(i, dict) and {"name", "shape", "datatype"} <= set(i) for i in inputs):
            raise InvalidInput("the request's JSON header needs 'inputs': a list of {name, shape, datatype, "
                               "parameters: {binary_data_size}}")
        if any("data" in i for i in inputs):
            return super().decode_inference_request(body, headers, model_name)
        sizes = [(i.get("parameters") or {}).get("binary_data_size") for i in inputs]
        for i, n in zip(inputs, sizes):
            if type(n) is not int or n < 0:
                raise InvalidInput(f"input {i['name']!r} has neither 'data' nor parameters.binary_data_size "
                                   f"(a byte count), got {n!r}")
        if head_len + sum(sizes) != len(body):
            raise InvalidInput(f"the inputs' binary_data_size add up to {sum(sizes)} bytes, but "
                               f"{len(body) - head_len} follow the JSON header")
        raw, pos = [], head_len
        for n in sizes:
            raw.append(body[pos:pos + n])
            pos += n
        outputs = [RequestedOutput(name=o["name"], parameters=o.get("parameters"))
                   for o in head.get("outputs") or [] if isinstance(o, dict) and "name" in o]
        return InferRequest(model_name=model_name, request_id=head.get("id"), raw_inputs=raw,
                            infer_inputs=[InferInput(name=i["name"], shape=i["shape"], datatype=i["datatype"],
                                                     parameters=i.get("parameters")) for i in inputs],
                            parameters=head.get("parameters"), request_outputs=outputs or None)


class _ModelServer(kserve.ModelServer):
    """KServe's ModelServer, its HTTP server bound to ``bind_host``.

    KServe's RESTServer binds 0.0.0.0 whatever it is given (its uvicorn.Config names the host, and
    no argument reaches it): right in a pod, but a local server on a workstation would answer
    every network the machine is on. The config is built in ``start`` and read when the server
    binds, in ``_serve``: the host is set in between. Should a KServe release rename these, the
    server binds 0.0.0.0 again, which the suite's test of a local server's address finds."""

    def __init__(self, bind_host: str, **kw):
        super().__init__(**kw)
        self.bind_host = bind_host
        self.dataplane = _RawDataPlane(model_registry=self.registered_models)

    async def _serve(self):
        if getattr(self, "_rest_server", None) is not None:
            self._rest_server.config.host = self.bind_host
        await super()._serve()


def main() -> None:
    parser = argparse.ArgumentParser(parents=[kserve.model_server.parser])
    parser.add_argument("--model_uri", default=os.environ.get("STORAGE_URI", "/mnt/models"),
                        help="model directory: local path (KServe's storage initializer mounts /mnt/models) or s3://")
    parser.add_argument("--bind_host", default="0.0.0.0",
                        help="the address the HTTP server binds: every interface in a pod (KServe's); a local "
                             "server binds 127.0.0.1, reachable from this machine only")
    parser.add_argument("--wait_for_port_s", type=float, default=0.0,
                        help="a redeploy's successor: load the model, print 'waiting for port', then take "
                             "--http_port as soon as the server serving on it lets it go (within this many seconds)")
    args, _ = parser.parse_known_args()
    import torch

    threads = os.environ.get("KFP_PYTORCH_SERVE_THREADS", "1")
    if not threads.isdigit() or int(threads) < 1:
        parser.error(f"KFP_PYTORCH_SERVE_THREADS: must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(int(threads))
    model = TorchPredictor(args.model_name, args.model_uri)
    try:
        model.load()
    except KfpPytorchError as e:  # the container's log says what and what to check, not a traceback
        if os.path.abspath(args.model_uri) == "/mnt/models":
            e.hint = ("KServe's storage initializer fills /mnt/models from STORAGE_URI on the kserve-container: check "
                      "that it names the model/ directory train wrote, and the initializer's log "
                      "(kubectl logs POD -c storage-initializer)")
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    if args.wait_for_port_s > 0 and not _wait_for_port(args.bind_host, args.http_port, args.wait_for_port_s):
        print(f"Error: port {args.http_port} was not let go within {args.wait_for_port_s:g}s", file=sys.stderr)
        sys.exit(1)
    # KServe's own responses use a FastAPI class that FastAPI now deprecates: a warning in every
    # server's log that no user of the server can act on
    warnings.filterwarnings("ignore", message="ORJSONResponse is deprecated")
    _ModelServer(args.bind_host, http_port=args.http_port, grpc_port=args.grpc_port, enable_grpc=args.enable_grpc,
                 workers=args.workers).start([model])


if __name__ == "__main__":
    main()
