"""KFP component wrapper of :mod:`kfp_pytorch.components.serve` (thin: parse inputs, call the runtime)."""
from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Input, Model

from .._kfp import COMPONENT_KW


@dsl.component(**COMPONENT_KW)
def serve_op(model: Input[Model], model_name: str, port: int = 0, backend: str = "local",
             canary_traffic_percent: int = -1, min_replicas: int = 1, max_replicas: int = 1,
             champion: bool = True, registered_model: str = ""
             ) -> NamedTuple("Outputs", [("endpoint", str), ("url", str)]):
    """Serve the model over the Open Inference Protocol v2 and smoke-test one prediction.
    ``champion`` False (register's verdict: it did not beat the champion, or takes other inputs): serve nothing, so the
    champion stays served (locally: its server is started again if it is down); the outputs are
    empty. ``registered_model`` (register's registry_uri, models:/NAME/VERSION) names the version
    served, in `serve list` and on the InferenceService."""
    from collections import namedtuple

    if not champion:
        note = "which stays served"
        if backend == "local":
            from kfp_pytorch.components.serve import keep_champion_served

            note = keep_champion_served(model_name)
        print(f"not served: this model is not the champion of {model_name!r} (the register step says why), {note}")
        return namedtuple("Outputs", ["endpoint", "url"])("", "")

    from kfp_pytorch.components.serve import ServeSpec, serve

    ep = serve(ServeSpec(model_uri=model.metadata.get("uri", model.path + "/model"), model_name=model_name,
                         port=port, backend=backend, canary_traffic_percent=canary_traffic_percent,
                         min_replicas=min_replicas, max_replicas=max_replicas, registered_model=registered_model))
    print(f"serving {model_name} at {ep.infer_url} (pid {ep.pid}); smoke test: {ep.smoke_test}")
    return namedtuple("Outputs", ["endpoint", "url"])(ep.infer_url, ep.url)
