"""The local model server (KServe ModelServer + our TorchPredictor) over real HTTP."""
import json
import re
import shutil
import socket

import numpy as np
import psutil
import pytest
import requests

from kfp_pytorch.components.errors import ConfigError, PortInUseError, ServingError
from kfp_pytorch.components.predictor import ModelRunner
from kfp_pytorch.components.prepare_data import load_split, read_metadata
from kfp_pytorch.components.serve import ServeSpec, infer, list_servers, serve, server_log, stop_server
from servers import free_port


@pytest.fixture
def endpoint(trained_model):
    ep = serve(ServeSpec(trained_model.model_uri, "digits"))
    yield ep
    stop_server("digits")


def _raw_rows(digits_data, n):
    x, y = load_split(digits_data, "test")
    norm = read_metadata(digits_data)["normalization"]
    return x[:n] * np.asarray(norm["std"]) + np.asarray(norm["mean"]), y[:n]


def test_open_inference_protocol_v2(endpoint, digits_data, trained_model):
    assert requests.get(f"{endpoint.url}/v2/health/ready").status_code == 200
    assert requests.get(f"{endpoint.url}/v2/models/digits/ready").status_code == 200
    assert endpoint.infer_url == f"{endpoint.url}/v2/models/digits/infer" and endpoint.smoke_test is not None
    rows, y = _raw_rows(digits_data, 32)
    resp = infer(endpoint.url, "digits", rows.tolist())
    out = {o["name"]: o for o in resp["outputs"]}
    assert out["probabilities"]["shape"] == [32, 10] and out["label"]["datatype"] == "INT64"
    labels = np.asarray(out["label"]["data"])
    assert (labels == y).mean() > 0.85
    # Same answers as the in-process runner (the served program is the evaluated one).
    _, local = ModelRunner(trained_model.model_uri).predict(rows)
    assert (labels == local).all()


def test_a_local_server_listens_on_loopback_only(endpoint):
    # KServe's server binds every interface whatever it is told: a model served on a workstation
    # answered its whole network. A local server binds the host of its URL, 127.0.0.1.
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(endpoint.pid).connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    assert listening == {("127.0.0.1", int(endpoint.url.rsplit(":", 1)[1]))}, listening


def test_a_batch_larger_than_the_exported_program_takes_is_served_in_chunks(trained_model):
    from kfp_pytorch.components.exported_model import EXPORT_MAX_BATCH

    runner = ModelRunner(trained_model.model_uri)
    rows = np.random.default_rng(0).normal(8, 5, size=(EXPORT_MAX_BATCH + 10, 64)).astype(np.float32)
    probs, labels = runner.predict(rows)  # failed the program's shape guard: an AssertionError, a 500
    assert probs.shape == (len(rows), 10) and labels.shape == (len(rows),)
    tail_probs, tail_labels = runner.predict(rows[-10:])
    assert np.allclose(probs[-10:], tail_probs, atol=1e-6) and (labels[-10:] == tail_labels).all()


_GRID = [f"pixel_{r}_{c}" for r in range(8) for c in range(8)]


@pytest.mark.parametrize("features, present, says", [
    # an image's pixels in another naming, or numbered from 1: named as a whole, with one pixel's rename
    (_GRID, {*(f"pixel{i}" for i in range(64)), "label"}, "; the table's columns pixel0 ... pixel63 are the 8x8 "
     "image's pixels named otherwise (the model's: pixel_0_0 ... pixel_7_7); rename them in row-major order "
     "('pixel9' is the model's 'pixel_1_1')"),
    ([f"pixel{i}" for i in range(64)], {f"pixel{i}" for i in range(1, 65)}, "1 of the model's 64 feature columns: "
     "['pixel0']; the table's columns pixel1 ... pixel64 are the 8x8 image's pixels named otherwise (the model's: "
     "pixel0 ... pixel63); rename them in row-major order ('pixel10' is the model's 'pixel9')"),
    (_GRID, {*(f"pixel{i}" for i in range(784)), "id"}, "; the table's columns pixel0 ... pixel783 are the pixels of "
     "28x28 images; the model takes 8x8 images (pixel_0_0 ... pixel_7_7): resize the images to 8x8, or train a "
     "model on 28x28 ones"),
    # not a whole image: no pixel is offered for another ('pixel10' is not 'pixel_1_0')
    (_GRID, {f"pixel{i}" for i in range(63)}, "['pixel_0_0', 'pixel_0_1', 'pixel_0_2', 'pixel_0_3', 'pixel_0_4', "
     "'pixel_0_5', 'pixel_0_6', 'pixel_0_7'] ...; the table has none of them (its columns: ['pixel0', 'pixel1', "
     "'pixel2', 'pixel3', 'pixel4', 'pixel5', 'pixel6', 'pixel7'] ...): is it the table of another model?$"),
    # a slip of letters keeps the numbers: another sensor is no rename
    (["sensor_10", "sensor_2"], {"sensor_11", "sensor_2"}, "1 of the model's 2 feature columns: ['sensor_10']$"),
    (["sensor_10", "sensor_2"], {"Sensor 10", "sensr_2"}, "did you mean 'Sensor 10' for 'sensor_10', 'sensr_2' for "
     "'sensor_2'?$"),
    (_GRID, {*_GRID} - {"pixel_0_3"} | {"Pixel_0_3"}, "['pixel_0_3']; did you mean 'Pixel_0_3' for 'pixel_0_3'?$"),
    # not one column in common: another model's table, and what it holds
    (_GRID, {"label", "a", "b"}, "'pixel_0_7'] ...; the table has none of them (its columns: ['a', 'b', 'label']): "
     "is it the table of another model?$"),
    (["age", "income"], {"income", "city"}, "1 of the model's 2 feature columns: ['age']$"),
])
def test_a_missing_column_is_named_with_what_the_table_has_instead(features, present, says):
    import re

    from kfp_pytorch.components.exported_model import lacking

    said = lacking(features, present)
    assert re.search(re.escape(says.rstrip("$")) + ("$" if says.endswith("$") else ""), said), said


def test_a_table_is_predicted_with_every_feature_column_type_training_takes(tmp_path):
    """A Parquet file's typed columns (booleans, pandas' nullable Int64, Float64 and boolean,
    Arrow's) and a notebook's categories of numbers were trained on, but serve predict refused the booleans
    and categories as not numeric and stopped on the nullable ones with a bare TypeError; each is
    now read as training reads it, and a gap in one is named as a NaN is."""
    import pandas as pd

    from kfp_pytorch.components.batch_predict import feature_matrix
    from kfp_pytorch.components.errors import DatasetError
    from kfp_pytorch.components.prepare_data import load_table, validate_table

    n = 40
    pd.DataFrame({"flag": np.arange(n) % 3 == 0, "count": pd.array(np.arange(n), dtype="Int64"),
                  "ratio": pd.array(np.linspace(0, 1, n), dtype="Float64"),
                  "seen": pd.array(np.arange(n) % 2 == 0, dtype="boolean"),
                  "arrow": pd.array(np.linspace(5, 6, n), dtype="double[pyarrow]"),
                  "pixel": np.arange(n, dtype=np.uint8) * 6, "label": np.arange(n) % 2}).to_parquet(tmp_path / "t.parquet")
    table = load_table(str(tmp_path / "t.parquet"))
    table["rooms"] = pd.Categorical(np.arange(n) % 4 + 1)  # a notebook's category column of numbers
    features = ["pixel", "arrow", "seen", "rooms", "ratio", "count", "flag"]  # the model's order, not the table's
    assert validate_table(table, "label") == []  # what training takes ...
    x, labels = feature_matrix(table, features, "label", "t.parquet")  # ... is predicted, the same numbers
    assert x.dtype == np.float32 and x.shape == (n, 7) and labels == (np.arange(n) % 2).tolist()
    np.testing.assert_array_equal(x, table[features].to_numpy(dtype=np.float32))
    # fewer rows than features (a few images of many pixels) are read as one copy: the same numbers
    np.testing.assert_array_equal(feature_matrix(table.head(5), features, "label", "t.parquet")[0], x[:5])
    gaps = table.copy()
    gaps.loc[1, "count"], gaps.loc[2, "seen"], gaps.loc[2, "arrow"] = pd.NA, pd.NA, None
    for rows in (gaps, gaps.head(5)):
        with pytest.raises(DatasetError, match=r"^t.parquet: 3 feature value\(s\) are empty, NaN or infinite: "
                                               r"row 2 'count', row 3 'arrow', row 3 'seen'"):
            feature_matrix(rows, features, "label", "t.parquet")
    # no numbers: dates (nanoseconds as numbers), categories of text, complex numbers; a name used twice
    for column, says in ((pd.to_datetime(np.arange(n), unit="D"), "row 1: Timestamp('1970-01-01 00:00:00')"),
                         (pd.Categorical(["a", "b"] * (n // 2)), "row 1: 'a'"), (np.ones(n) * 1j, "row 1: ")):
        with pytest.raises(DatasetError, match=re.escape(f"t.parquet: feature column 'ratio' is not numeric ({says}")):
            feature_matrix(table.assign(ratio=column), features, "label", "t.parquet")
    for twice in ("ratio", "label"):
        with pytest.raises(DatasetError, match=f"^t.parquet has a column named twice: '{twice}'\n  hint: give each "
                                               "column a name of its own"):
            feature_matrix(pd.concat([table, table[[twice]]], axis=1), features, "label", "t.parquet")


def test_bad_request_gets_a_400_not_a_crash(endpoint):
    body = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    r = requests.post(endpoint.infer_url, json=body)
    assert r.status_code == 400 and "expected input of shape [n, 64]" in r.text
    for inp, needle in (({"shape": [1, 64], "datatype": "FP32", "data": [1, 2]}, "do not fill shape [1, 64]"),
                        ({"shape": [1, 64], "datatype": "BYTES", "data": ["a"]}, "datatype BYTES is not supported")):
        r = requests.post(endpoint.infer_url, json={"inputs": [{"name": "x", **inp}]})
        assert r.status_code == 400 and needle in r.text, r.text
    big = [0.0] * 64
    big[5] = 1e39  # beyond FP32: infinite once cast
    r = requests.post(endpoint.infer_url, json={"inputs": [{"name": "x", "shape": [2, 64], "datatype": "FP32",
                                                            "data": [0.0] * 64 + big}]})
    assert r.status_code == 400 and "rows [1] hold NaN or infinite features" in r.text, r.text
    r = requests.post(endpoint.url + "/v1/models/digits:predict", json={"instances": [[1, 2], [3]]})
    assert r.status_code == 400 and "instances: must be rows of numbers" in r.text, r.text
    ok = requests.post(endpoint.url + "/v1/models/digits:predict", json={"instances": [[0.0] * 64] * 2})
    assert ok.status_code == 200 and len(ok.json()["predictions"]) == 2
    r = requests.post(endpoint.url + "/v1/models/digits:predict", json={"instances": []})
    assert r.status_code == 200 and r.json() == {"predictions": []}, r.text
    r = requests.post(endpoint.url + "/v1/models/digits:predict", json={"inputs": [[0.0] * 64]})
    assert r.status_code == 400 and 'a v1 request is {"instances": [[features...], ...]}' in r.json()["error"], r.text
    # a second input was ignored (features split across inputs were answered from the first alone)
    two = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64},
                      {"name": "y", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}
    r = requests.post(endpoint.infer_url, json=two)
    assert r.status_code == 400 and "the model takes one input" in r.text and "the request has 2: 'x', 'y'" in r.text
    r = requests.post(endpoint.infer_url, json={"inputs": [{"name": "x", "shape": [1, 64], "datatype": "INT64",
                                                            "data": [2 ** 70] * 64}]})
    assert r.status_code == 400 and "do not fill shape [1, 64]" in r.text, r.text  # was a 500 (OverflowError)
    assert requests.get(f"{endpoint.url}/v2/health/ready").status_code == 200


def test_a_malformed_binary_request_gets_a_400_that_says_what_is_wrong(endpoint):
    # the binary tensor extension's sizes and header, checked before any row is read (KServe's own
    # reading answered sizes that do not add up, or a header length that is no number, with a 500)
    x = np.zeros((2, 64), "<f4").tobytes()

    def post(head, raw, head_len=None):
        h = json.dumps(head).encode() if isinstance(head, dict) else head
        return requests.post(endpoint.infer_url, data=h + raw, headers={
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(h) if head_len is None else head_len)})

    def inp(**kw):
        return {"inputs": [{"name": "input-0", "shape": [2, 64], "datatype": "FP32", **kw}]}

    ok = post(inp(parameters={"binary_data_size": len(x)}), x)
    assert ok.status_code == 200 and ok.json()["outputs"][1]["shape"] == [2]
    one = post({**inp(parameters={"binary_data_size": len(x)}), "outputs": [{"name": "label"}], "id": "r1"}, x)
    assert [o["name"] for o in one.json()["outputs"]] == ["label"] and one.json()["id"] == "r1", one.text
    for r, says in (
            (post(inp(parameters={"binary_data_size": len(x)}), x[:100]),
             "the inputs' binary_data_size add up to 512 bytes, but 100 follow the JSON header"),
            (post(inp(parameters={"binary_data_size": 100}), x),
             "the inputs' binary_data_size add up to 100 bytes, but 512 follow the JSON header"),
            (post(inp(parameters={"binary_data_size": "512"}), x),
             "input 'input-0' has neither 'data' nor parameters.binary_data_size (a byte count), got '512'"),
            (post(inp(), x), "input 'input-0' has neither 'data' nor parameters.binary_data_size"),
            (post(inp(parameters={"binary_data_size": len(x)}), x, head_len="abc"),
             "Inference-Header-Content-Length: 'abc' is not the length in bytes of the request's JSON header"),
            (post(inp(parameters={"binary_data_size": len(x)}), x, head_len=10 ** 6),
             "Inference-Header-Content-Length: '1000000' is not the length"),
            (post(b"{notjson", x), "the request's JSON header (its first 8 bytes) does not parse"),
            (post({"inputs": 5}, b""), "the request's JSON header needs 'inputs': a list of"),
            (post(inp(parameters={"binary_data_size": 256}), x[:256]), "its data do not fill shape [2, 64]")):
        assert r.status_code == 400 and says in r.json()["error"], r.text
    assert requests.get(f"{endpoint.url}/v2/health/ready").status_code == 200


def test_a_table_is_taken_one_input_per_column_by_name_as_kserves_tabular_servers_take_it(endpoint):
    from kfp_pytorch.components.prepare_data import load_table

    table = load_table("sample://digits").head(5)
    features = [c for c in table.columns if c != "label"]
    rows = {"inputs": [{"name": "x", "shape": [5, 64], "datatype": "FP32",
                        "data": table[features].to_numpy(np.float32).ravel().tolist()}]}
    expected = requests.post(endpoint.infer_url, json=rows).json()["outputs"][1]["data"]
    # columns in another order, an id (BYTES) beside them, flagged as a DataFrame or not
    columns = [{"name": c, "shape": [5], "datatype": "FP32", "data": table[c].astype(float).tolist()}
               for c in features[::-1]]
    ident = {"name": "id", "shape": [5], "datatype": "BYTES", "data": [f"r{i}" for i in range(5)]}
    for body in ({"inputs": [ident, *columns], "parameters": {"content_type": "pd"}}, {"inputs": [*columns, ident]}):
        r = requests.post(endpoint.infer_url, json=body)
        assert r.status_code == 200 and r.json()["outputs"][1]["data"] == expected, r.text
    r = requests.post(endpoint.infer_url, json={"inputs": [c for c in columns if c["name"] != "pixel_3_3"]})
    assert r.status_code == 400 and "lacks 1 of the model's 64 feature columns: ['pixel_3_3']" in r.text, r.text
    # a renamed column is named beside the one it stands for; an input the model does not take is named
    renamed = [{**c, "name": "Pixel_3_3"} if c["name"] == "pixel_3_3" else c for c in columns]
    r = requests.post(endpoint.infer_url, json={"inputs": [*renamed, {**ident, "name": "zz"}]})
    assert r.status_code == 400 and ("lacks 1 of the model's 64 feature columns: ['pixel_3_3']; did you mean "
                                     "'Pixel_3_3' for 'pixel_3_3'?; inputs the model does not take: ['Pixel_3_3', 'zz']"
                                     ) in r.json()["error"], r.text
    # a boolean column, as a DataFrame's bool column is sent (KServe's InferInput: BOOL), is read as training
    # reads it: 1 and 0; text is not
    flags = (table["pixel_3_3"] > 8).tolist()
    as_numbers = [{**c, "data": [float(f) for f in flags]} if c["name"] == "pixel_3_3" else c for c in columns]
    want = requests.post(endpoint.infer_url, json={"inputs": as_numbers}).json()["outputs"]
    as_bools = [{**c, "datatype": "BOOL", "data": flags} if c["name"] == "pixel_3_3" else c for c in columns]
    r = requests.post(endpoint.infer_url, json={"inputs": as_bools})
    assert r.status_code == 200 and r.json()["outputs"] == want and len(set(flags)) == 2, r.text
    # ... and as binary tensors: a byte a value (KServe's and Triton's clients send a bool column so)
    raw = [np.asarray(c["data"], np.bool_ if c["datatype"] == "BOOL" else "<f4").tobytes() for c in as_bools]
    head = json.dumps({"inputs": [{**{k: c[k] for k in ("name", "shape", "datatype")},
                                   "parameters": {"binary_data_size": len(b)}} for c, b in zip(as_bools, raw)]}).encode()
    r = requests.post(endpoint.infer_url, data=head + b"".join(raw), headers={
        "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 200 and r.json()["outputs"] == want, r.text
    assert len(raw[[c["name"] for c in as_bools].index("pixel_3_3")]) == 5  # the BOOL column went as 5 bytes
    as_text = [{**c, "datatype": "BYTES", "data": list(map(str, flags))} if c["name"] == "pixel_3_3" else c
               for c in columns]
    r = requests.post(endpoint.infer_url, json={"inputs": as_text})
    assert r.status_code == 400 and "input 'pixel_3_3': datatype BYTES is not supported; a feature column is numeric " \
                                    "(or BOOL)" in r.json()["error"], r.text
    short = [{**c, "shape": [4], "data": c["data"][:4]} if c["name"] == "pixel_0_1" else c for c in columns]
    r = requests.post(endpoint.infer_url, json={"inputs": short})
    assert r.status_code == 400 and "input 'pixel_0_1': a column is of shape [n] (every column the same n)" in r.text
    # the model metadata declares that form: one FP32 column per feature, by name; and the outputs
    meta = requests.get(f"{endpoint.url}/v2/models/digits").json()
    assert meta["inputs"] == [{"name": f, "datatype": "FP32", "shape": [-1]} for f in features]
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]},
                               {"name": "label", "datatype": "INT64", "shape": [-1]}]
    # v1: records by column name, as KServe's sklearn server reads them
    records = table.assign(id=range(5)).to_dict(orient="records")
    r = requests.post(endpoint.url + "/v1/models/digits:predict", json={"instances": records})
    assert r.status_code == 200 and r.json()["predictions"] == expected, r.text
    r = requests.post(endpoint.url + "/v1/models/digits:predict",
                      json={"instances": [{k: v for k, v in rec.items() if k != "pixel_2_5"} for rec in records]})
    assert r.status_code == 400 and "records lack 1 of the model's 64 feature columns: ['pixel_2_5']" in r.text, r.text


def test_only_the_requested_outputs_are_returned(endpoint):
    x = {"name": "x", "shape": [2, 64], "datatype": "FP32", "data": [0.0] * 128}
    r = requests.post(endpoint.infer_url, json={"inputs": [x], "outputs": [{"name": "label"}]})
    assert r.status_code == 200 and [o["name"] for o in r.json()["outputs"]] == ["label"], r.text
    r = requests.post(endpoint.infer_url, json={"inputs": [x]})
    assert [o["name"] for o in r.json()["outputs"]] == ["probabilities", "label"]
    r = requests.post(endpoint.infer_url, json={"inputs": [x], "outputs": [{"name": "score"}]})
    assert r.status_code == 400 and "outputs ['score'] are not outputs of this model" in r.text, r.text
    r = requests.post(endpoint.infer_url, json={"inputs": [{**x, "shape": [0, 64], "data": []}]})
    assert r.status_code == 200 and r.json()["outputs"][1]["shape"] == [0], r.text
    assert requests.get(f"{endpoint.url}/v2/health/ready").status_code == 200


def test_an_image_models_rows_may_come_as_images(endpoint, digits_data, trained_model):
    """A model trained on an image's pixels takes a batch as images too, [n, C, H, W] as PyTorch and
    KServe's image clients send them ([n, H, W] for one channel), in JSON, in binary and in v1."""
    assert ModelRunner(trained_model.model_uri).meta["image_shape"] == [1, 8, 8]
    rows, _ = _raw_rows(digits_data, 6)
    rows = rows.astype(np.float32)
    want = infer(endpoint.url, "digits", rows.tolist())["outputs"][1]["data"]
    for shape in ([6, 1, 8, 8], [6, 8, 8]):
        body = {"inputs": [{"name": "images", "shape": shape, "datatype": "FP32", "data": rows.ravel().tolist()}]}
        r = requests.post(endpoint.infer_url, json=body)
        assert r.status_code == 200 and r.json()["outputs"][1]["data"] == want, r.text
        header = json.dumps({"inputs": [{"name": "images", "shape": shape, "datatype": "FP32",
                                         "parameters": {"binary_data_size": rows.nbytes}}]}).encode()
        r = requests.post(endpoint.infer_url, data=header + rows.tobytes(),
                          headers={"Inference-Header-Content-Length": str(len(header)),
                                   "Content-Type": "application/octet-stream"})
        assert r.status_code == 200 and r.json()["outputs"][1]["data"] == want, r.text
    r = requests.post(endpoint.url + "/v1/models/digits:predict", json={"instances": rows.reshape(6, 8, 8).tolist()})
    assert r.status_code == 200 and r.json()["predictions"] == want, r.text
    # other images: the error names the shapes the model takes
    r = requests.post(endpoint.infer_url, json={"inputs": [{"name": "images", "shape": [1, 2, 4, 8], "datatype": "FP32",
                                                            "data": [0.0] * 64}]})
    assert r.status_code == 400 and ("expected input of shape [n, 64] (or images, [n, 1, 8, 8] or [n, 8, 8]), "
                                     "got [1, 2, 4, 8]") in r.text, r.text


def test_client_errors_say_what_to_do(endpoint):
    # A server error keeps the server's message; a second call on the same kept-alive pool still works.
    with pytest.raises(ServingError, match="HTTP 400: .*expected input of shape \\[n, 64\\]"):
        infer(endpoint.url, "digits", [[1.0, 2.0, 3.0]])
    assert len(infer(endpoint.url, "digits", [[0.0] * 64])["outputs"][1]["data"]) == 1
    with pytest.raises(ServingError, match="serves no model named 'no-such-model' \\(it serves: 'digits'\\)") as e:
        infer(endpoint.url, "no-such-model", [[0.0] * 64])
    assert "the name the model is served under" in str(e.value)
    with pytest.raises(ServingError, match="no rows to send"):
        infer(endpoint.url, "digits", [])
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServingError, match=f"could not reach the model server at http://127.0.0.1:{port}/") as e:
        infer(f"http://127.0.0.1:{port}", "digits", [[0.0] * 64], timeout=2)
    assert "kfp-pytorch serve list" in str(e.value)
    with pytest.raises(ServingError, match="not a model server URL: '127.0.0.1:8080'[\\s\\S]*e.g. http://"):
        infer("127.0.0.1:8080", "digits", [[0.0] * 64])
    # A base URL with a trailing slash, or behind a path prefix, reaches the same model.
    assert infer(endpoint.url + "/", "digits", [[0.0] * 64])["model_name"] == "digits"
    with pytest.raises(ServingError, match="HTTP 404"):
        infer(endpoint.url + "/serving/ns", "digits", [[0.0] * 64])  # the prefix is sent, not dropped
    with pytest.raises(ServingError, match=f"server at http://127.0.0.1:{port}/serving/ns/v2/models/digits/infer:"):
        infer(f"http://127.0.0.1:{port}/serving/ns", "digits", [[0.0] * 64], timeout=2)


def test_client_survives_a_redeploy_on_the_same_port(trained_model):
    # The client keeps its connection alive between calls. A redeploy closes it on the server's
    # side; the next call must notice and reconnect, not fail on the dead connection.
    row = [[0.0] * 64]
    ep = serve(ServeSpec(trained_model.model_uri, "redeploy"))
    port = int(ep.url.rsplit(":", 1)[1])
    try:
        assert infer(ep.url, "redeploy", row)["model_name"] == "redeploy"
        stop_server("redeploy")
        again = serve(ServeSpec(trained_model.model_uri, "redeploy", port=port))
        assert again.url == ep.url and again.pid != ep.pid
        assert infer(ep.url, "redeploy", row)["model_name"] == "redeploy"
        stop_server("redeploy")
        with pytest.raises(ServingError, match=f"could not reach the model server at http://127.0.0.1:{port}/"):
            infer(ep.url, "redeploy", row, timeout=2)
    finally:
        stop_server("redeploy")


def test_a_failed_redeploy_leaves_the_running_server_serving(trained_model, tmp_path):
    # Serving a name again stopped the running server first: a model that failed to load left
    # nothing serving. Now the old one goes only once the new one is ready and answered.
    from kfp_pytorch.components.paths import home

    row = [[0.0] * 64]
    old = serve(ServeSpec(trained_model.model_uri, "swap"))
    try:
        with pytest.raises(ServingError) as e:  # nothing there: said before a server starts
            serve(ServeSpec(str(tmp_path / "nothing"), "swap"))
        assert str(e.value).startswith(f"no trained model at {tmp_path / 'nothing'}")
        with pytest.raises(ServingError) as e:  # a model the new server cannot load
            serve(ServeSpec(_broken_model(trained_model.model_uri, tmp_path / "broken"), "swap"))
        assert "exited" in str(e.value) and f"the server already serving swap keeps serving: {old.infer_url}" in str(e.value)
        assert infer(old.url, "swap", row)["model_name"] == "swap"
        [info] = [s for s in list_servers() if s["name"] == "swap"]
        assert info["pid"] == old.pid and info["alive"]
        new = serve(ServeSpec(trained_model.model_uri, "swap"))  # a good model takes over, and its URL
        assert new.pid != old.pid and new.url == old.url and new.smoke_test is not None and new.note is None
        assert not psutil.pid_exists(old.pid) or psutil.Process(old.pid).status() == psutil.STATUS_ZOMBIE
        assert infer(new.url, "swap", row)["model_name"] == "swap"
        [info] = [s for s in list_servers() if s["name"] == "swap"]
        assert info["pid"] == new.pid
        logs = sorted(p.name for p in (home() / "servers").glob("swap*.log"))
        assert logs == ["swap.log", "swap.previous.log"]  # the one it replaced: `serve logs --previous`
        assert str(new.pid) in (home() / "servers" / "swap.log").read_text()
        assert str(old.pid) in (home() / "servers" / "swap.previous.log").read_text()
    finally:
        stop_server("swap")


def _broken_model(model_uri: str, to) -> str:
    """A copy of the model at ``model_uri`` whose program does not load: its server starts, then
    exits (a model that is missing altogether is refused before any server starts)."""
    shutil.copytree(model_uri, to)
    (to / "model.pt2").write_bytes(b"not a program")
    return str(to)


def _another_model(model_uri: str, to) -> str:
    """A copy of the model at ``model_uri`` that is another model by content (its fingerprint,
    the responses' model_version), as a retraining's would be."""
    import shutil

    shutil.copytree(model_uri, to)
    meta = json.loads((to / "metadata.json").read_text())
    (to / "metadata.json").write_text(json.dumps({**meta, "retrained": True}))
    return str(to)


def _predictors(name: str) -> list[int]:
    return sorted(p.pid for p in psutil.process_iter(["cmdline"])
                  if "kfp_pytorch.components.kserve_predictor" in (p.info["cmdline"] or [])
                  and name in (p.info["cmdline"] or []))


def test_a_redeploy_keeps_the_url_and_the_old_model_serves_until_the_new_one_passed(trained_model, tmp_path):
    # A redeploy moved the endpoint to a new free port, so a notebook's or a script's URL broke
    # at every retraining; and on a pinned port the old server was stopped before the new one
    # loaded, so a model that failed left nothing serving.
    row = [[0.0] * 64]
    pinned = free_port()
    old = serve(ServeSpec(trained_model.model_uri, "keep", port=pinned))
    try:
        before = infer(old.url, "keep", row)["model_version"]
        assert before and len(before) == 12
        with pytest.raises(ServingError) as e:
            serve(ServeSpec(_broken_model(trained_model.model_uri, tmp_path / "broken"), "keep", port=pinned))
        assert f"the server already serving keep keeps serving: {old.infer_url}" in str(e.value)
        assert infer(old.url, "keep", row)["model_version"] == before and _predictors("keep") == [old.pid]

        retrained = _another_model(trained_model.model_uri, tmp_path / "retrained")
        new = serve(ServeSpec(retrained, "keep"))  # port 0: the name's URL
        assert new.url == old.url and new.pid != old.pid and new.replaced["pid"] == old.pid
        after = infer(old.url, "keep", row)
        assert after["model_version"] == ModelRunner(retrained).fingerprint != before  # the new model answers
        assert _predictors("keep") == [new.pid]  # the old server and the trial are gone
        [info] = [s for s in list_servers() if s["name"] == "keep"]
        assert info["pid"] == new.pid and info["url"] == old.url and info["model_uri"] == retrained
        assert sorted(p.name for p in server_log("keep").parent.glob("keep*.log")) == ["keep.log", "keep.previous.log"]
        assert str(new.pid) in server_log("keep").read_text()  # the successor's log, under the usual name
    finally:
        stop_server("keep")


def test_a_successor_that_cannot_take_the_port_leaves_the_tried_server_serving_and_says_the_url_changed(
        trained_model):
    from kfp_pytorch.components.serve import LocalServeBackend

    old = serve(ServeSpec(trained_model.model_uri, "moved"))
    old_port = int(old.url.rsplit(":", 1)[1])

    def fails_on_the_old_port(ep):
        if int(ep.url.rsplit(":", 1)[1]) == old_port:
            raise ServingError("answered nonsense")
        infer(ep.url, ep.name, [[0.0] * 64])

    try:
        new = LocalServeBackend().start(ServeSpec(trained_model.model_uri, "moved"), check=fails_on_the_old_port)
        assert new.url != old.url and new.note == (f"port {old_port} could not be taken over (answered nonsense): "
                                                   f"moved is served at {new.url}, clients of the old URL must change")
        assert infer(new.url, "moved", [[0.0] * 64])["model_name"] == "moved"
        assert _predictors("moved") == [new.pid]  # neither the old server nor the successor is left
        [info] = [s for s in list_servers() if s["name"] == "moved"]
        assert info["pid"] == new.pid and info["url"] == new.url and info["alive"]
    finally:
        stop_server("moved")


def test_a_smoke_test_that_fails_otherwise_also_leaves_the_running_server_serving(trained_model):
    # Only a ServingError from the smoke test carried the "keeps serving" note; a storage error
    # reading the sample row lost it, and anything else escaped as a bare traceback.
    from kfp_pytorch.components.errors import StorageUnreachable
    from kfp_pytorch.components.serve import LocalServeBackend

    def s3_down(ep):
        raise StorageUnreachable("cannot reach S3 at http://minio:9000", "check the endpoint")

    def bad_answer(ep):
        raise KeyError("outputs")

    spec = ServeSpec(trained_model.model_uri, "smoke")
    old = serve(spec)
    try:
        with pytest.raises(StorageUnreachable) as e:
            LocalServeBackend().start(spec, check=s3_down)
        assert str(e.value).startswith("cannot reach S3 at http://minio:9000\n"
                                       f"  the server already serving smoke keeps serving: {old.infer_url}")
        assert e.value.hint == "check the endpoint"
        with pytest.raises(ServingError) as e:
            LocalServeBackend().start(spec, check=bad_answer)
        msg = str(e.value)
        assert "the smoke test of http://127.0.0.1:" in msg and "failed: KeyError: 'outputs'" in msg
        assert f"the server already serving smoke keeps serving: {old.infer_url}" in msg and "smoke.new.log" in msg
        [info] = [s for s in list_servers() if s["name"] == "smoke"]
        assert info["pid"] == old.pid and info["alive"]
        assert infer(old.url, "smoke", [[0.0] * 64])["model_name"] == "smoke"
    finally:
        stop_server("smoke")
    # with nothing serving before, the same failure is still a ServingError, with no note
    with pytest.raises(ServingError) as e:
        LocalServeBackend().start(spec, check=bad_answer)
    assert "keeps serving" not in str(e.value) and not [s for s in list_servers() if s["name"] == "smoke"]


def test_rows_sent_as_binary_tensors_get_the_answer_json_rows_get(endpoint, digits_data):
    # the protocol's binary tensor extension (raw FP32 after the JSON header): KServe's server reads
    # it as it reads JSON numbers, so batch prediction sends it (JSON encoding was half its time)
    rows, _ = _raw_rows(digits_data, 40)
    as_json = infer(endpoint.url, "digits", rows.tolist())
    as_binary = infer(endpoint.url, "digits", rows, binary=True)
    assert as_binary["outputs"] == as_json["outputs"] and {o["name"] for o in as_json["outputs"]} >= {"label", "probabilities"}
    assert as_binary["model_version"] == as_json["model_version"]
    # and the answer comes back binary too when asked (binary_data_output, as Triton honours it):
    # decoding JSON outputs was most of what was left of a batch's time
    x = np.ascontiguousarray(rows, dtype="<f4")
    head = json.dumps({"inputs": [{"name": "input-0", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "parameters": {"binary_data_output": True}}).encode()
    r = requests.post(endpoint.infer_url, data=head + x.tobytes(), headers={
        "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))})
    n = int(r.headers["Inference-Header-Content-Length"])
    outs = {o["name"]: o for o in json.loads(r.content[:n])["outputs"]}
    assert "data" not in outs["probabilities"] and outs["probabilities"]["parameters"]["binary_data_size"] == 40 * 10 * 4
    assert outs["label"]["parameters"]["binary_data_size"] == 40 * 8 and len(r.content) == n + 40 * 10 * 4 + 40 * 8
    expected = {o["name"]: o["data"] for o in as_json["outputs"]}
    raw = r.content[n:]  # the outputs' bytes in the header's order
    offsets = np.cumsum([0] + [outs[o["name"]]["parameters"]["binary_data_size"] for o in json.loads(r.content[:n])["outputs"]])
    for (name, out), start in zip(outs.items(), offsets):
        kind = "<f4" if out["datatype"] == "FP32" else "<i8"
        assert np.frombuffer(raw[start:start + out["parameters"]["binary_data_size"]], kind).tolist() == expected[name]
    with pytest.raises(ServingError, match="no rows to send"):
        infer(endpoint.url, "digits", np.zeros((0, 64)), binary=True)


def test_each_named_output_is_answered_binary_or_json_as_its_binary_data_says(endpoint, digits_data):
    # the extension's per-output choice (as Triton reads it): an output named with
    # parameters.binary_data as it says, the others as binary_data_output says. KServe's own
    # to_rest answered every named output in JSON unless it said binary_data itself.
    from kfp_pytorch.components.serve import _binary_response

    rows, _ = _raw_rows(digits_data, 8)
    expected = {o["name"]: o["data"] for o in infer(endpoint.url, "digits", rows.tolist())["outputs"]}

    def ask(outputs, **params):
        body = {"inputs": [{"name": "input-0", "shape": list(rows.shape), "datatype": "FP32",
                            "data": rows.ravel().tolist()}], "outputs": outputs, "parameters": params}
        return requests.post(endpoint.infer_url, json=body)

    for outputs, params, raw in (
            ([{"name": "label"}, {"name": "probabilities", "parameters": {"binary_data": False}}],
             {"binary_data_output": True}, {"label"}),
            ([{"name": "probabilities", "parameters": {"binary_data": True}}, {"name": "label"}], {}, {"probabilities"}),
            ([{"name": "label", "parameters": {"binary_data": True}}], {"binary_data_output": False}, {"label"})):
        r = ask(outputs, **params)
        assert r.status_code == 200, r.text
        n = int(r.headers["Inference-Header-Content-Length"])
        head = json.loads(r.content[:n])
        assert [o["name"] for o in head["outputs"]] == [o["name"] for o in outputs]  # the request's order
        assert {o["name"] for o in head["outputs"] if "data" not in o} == raw, (outputs, params)
        decoded = _binary_response(r.content, n, endpoint.url)
        assert {o["name"]: o["data"] for o in decoded["outputs"]} == {o["name"]: expected[o["name"]] for o in outputs}
    r = ask([{"name": "label", "parameters": {"binary_data": "yes"}}])
    assert r.status_code == 400 and "output 'label': parameters.binary_data is true or false, not 'yes'" in r.text


def test_a_server_without_binary_tensors_is_sent_json_from_the_first_batch_on(tmp_path):
    # another OIP server (one without the binary extension) refuses the raw rows with a 400: the same
    # batch goes again as JSON numbers, and every batch after it
    import http.server
    import threading

    from kfp_pytorch.components.batch_predict import Target, predict_rows

    seen = []

    class JsonOnly(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(self.headers["Content-Type"])
            if "Inference-Header-Content-Length" in self.headers:
                self.send_response(400)
                self.end_headers()
                self.wfile.write(b'{"error": "binary data is not supported"}')
                return
            inp = json.loads(body)["inputs"][0]
            n = inp["shape"][0]
            data = np.asarray(inp["data"]).reshape(n, -1)
            label = (data[:, 0] > 0).astype(int)  # a model of the first feature's sign
            probs = np.stack([1.0 - label, label.astype(float)], axis=1)
            out = json.dumps({"outputs": [
                {"name": "label", "shape": [n], "datatype": "INT64", "data": label.tolist()},
                {"name": "probabilities", "shape": [n, 2], "datatype": "FP32", "data": probs.ravel().tolist()}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(out.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), JsonOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        x = np.array([[1.0, 5.0], [-2.0, 0.0], [3.0, 1.0], [-1.0, 2.0], [0.5, 0.5]], dtype=np.float32)
        got = predict_rows(Target(f"http://127.0.0.1:{server.server_address[1]}", "stub"), x, batch_size=2)
    finally:
        server.shutdown()
        server.server_close()
    assert got["label"] == [1, 0, 1, 0, 1] and got["confidence"] == [1.0] * 5
    assert seen == ["application/octet-stream"] + ["application/json"] * 3  # one binary try, then JSON
    # no batch size given: about 4 MiB of features a request, at most 4096 rows (5000 rows: two requests)
    seen.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), JsonOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        many = np.tile(x, (1000, 1))
        got = predict_rows(Target(f"http://127.0.0.1:{server.server_address[1]}", "stub"), many, binary=False)
        assert len(seen) == 2 and got["label"] == [1, 0, 1, 0, 1] * 1000
        # serve predict --encoding json: JSON from the first request on, never a binary try
        import subprocess
        import sys

        seen.clear()
        table = tmp_path / "rows.csv"
        table.write_text("a,b\n" + "".join(f"{r[0]},{r[1]}\n" for r in x))
        r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", "stub", str(table), "--url",
                            f"http://127.0.0.1:{server.server_address[1]}", "--encoding", "json"],
                           capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 0 and "5 rows predicted by stub" in r.stderr, r.stderr
    assert seen == ["application/json"]


@pytest.mark.parametrize("features, rows", [(2, 4096), (64, 4096), (784, 1337), (3 * 224 * 224, 6), (10 ** 7, 1)])
def test_a_batch_carries_about_4_mib_of_features_by_default(features, rows):
    from kfp_pytorch.components.batch_predict import default_batch_rows

    assert default_batch_rows(features) == rows


@pytest.mark.parametrize("outputs, tail, says", [
    ([{"name": "label", "shape": [2], "datatype": "INT64", "parameters": {"binary_data_size": 16}}],
     b"\x01" + b"\x00" * 7, "output 'label' has 8 of its 16 bytes"),
    ([{"name": "class", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}],
     b"\x09\x00\x00\x00ab", "output 'class': an element of 9 bytes runs past its 6"),
    ([{"name": "x", "shape": [1], "datatype": "COMPLEX", "parameters": {"binary_data_size": 1}}],
     b"\x00", "datatype 'COMPLEX', which has no binary form"),
    (["label"], b"", "its JSON header is not an object whose 'outputs' is a list of outputs"),
])
def test_a_malformed_binary_answer_is_an_error_that_says_how_to_go_on(outputs, tail, says):
    # a server's binary outputs that do not add up are never read as numbers of another row
    import http.server
    import threading

    class Truncating(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            head = json.dumps({"model_name": "stub", "outputs": outputs}).encode()
            self.send_response(200)
            self.send_header("Inference-Header-Content-Length", str(len(head)))
            self.send_header("Content-Length", str(len(head) + len(tail)))
            self.end_headers()
            self.wfile.write(head + tail)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Truncating)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ServingError) as e:
            infer(f"http://127.0.0.1:{server.server_address[1]}", "stub", np.zeros((2, 3)), binary=True)
    finally:
        server.shutdown()
        server.server_close()
    assert "sent a malformed binary response" in e.value.message and says in e.value.message
    assert "--encoding json" in e.value.hint and "binary=False" in e.value.hint


def test_a_server_that_drops_the_request_is_not_asked_again_as_json():
    # only an answered refusal means "no binary tensors here": a server that cannot be reached or
    # hangs (60 s a batch) is not asked a second time, which would double the wait before the error
    import http.server
    import threading

    from kfp_pytorch.components.batch_predict import Target, predict_rows

    seen = []

    class Drops(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers["Content-Type"])
            self.close_connection = True  # no answer: the client sees the connection closed

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drops)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ServingError, match="rows 1-2: could not reach the model server"):
            predict_rows(Target(f"http://127.0.0.1:{server.server_address[1]}", "stub"), np.ones((3, 2)), batch_size=2)
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["application/octet-stream"]


def test_serve_predict_sends_a_whole_table_by_feature_name(endpoint, trained_model, tmp_path):
    import subprocess
    import sys

    import pandas as pd

    from kfp_pytorch.components.prepare_data import load_table

    cli = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    table = load_table("sample://digits")
    features = [c for c in table.columns if c != "label"]
    # columns in another order, an id column the model never saw: matched by name
    shuffled = table[["label", *features[::-1]]].assign(id=range(len(table)))
    shuffled.to_csv(tmp_path / "rows.csv", index=False)
    r = cli("digits", str(tmp_path / "rows.csv"), "--batch-size", "500")
    assert r.returncode == 0, r.stderr
    import io

    out = pd.read_csv(io.StringIO(r.stdout))
    assert list(out.columns) == ["row", "prediction", "confidence", "label"] and len(out) == len(table)
    _, expected = ModelRunner(trained_model.model_uri).predict(table[features].to_numpy(np.float32))
    assert (out["prediction"].to_numpy() == expected).all() and (out["label"] == table["label"]).all()
    assert ((out["confidence"] > 0) & (out["confidence"] <= 1)).all()
    acc = float((expected == table["label"].to_numpy()).mean())
    assert f"{len(table)} rows predicted by digits at {endpoint.url}; accuracy against 'label': {acc:.4f}" in r.stderr
    # ... and the class found least often, with what its rows were taken for
    truth = table["label"].to_numpy()
    recall = {c: float((expected[truth == c] == c).mean()) for c in range(10)}
    worst = min(range(10), key=lambda c: (recall[c], c))
    taken = np.bincount(np.where(expected[truth == worst] == worst, 10, expected[truth == worst]), minlength=11)[:10]
    assert (f"; weakest: class {worst}, recall {recall[worst]:.4f} ({(expected[truth == worst] == worst).sum()} of "
            f"{(truth == worst).sum()} rows); {taken.max()} taken for {taken.argmax()}\n") in r.stderr, r.stderr
    # by URL (a server not started here, without the model's directory): the server's model metadata
    # names the features, so the columns still go by name
    r = cli("digits", str(tmp_path / "rows.csv"), "--url", endpoint.url, "-o", str(tmp_path / "p.csv"))
    assert r.returncode == 0 and r.stdout == "" and f"accuracy against 'label': {acc:.4f}" in r.stderr, r.stderr
    assert (pd.read_csv(tmp_path / "p.csv")["prediction"].to_numpy() == expected).all()
    # JSON numbers both ways, for a server whose binary tensors go wrong: the same file
    r = cli("digits", str(tmp_path / "rows.csv"), "--url", endpoint.url, "--encoding", "json", "--probabilities",
            "-o", str(tmp_path / "pj.csv"))
    assert r.returncode == 0, r.stderr
    r = cli("digits", str(tmp_path / "rows.csv"), "--url", endpoint.url, "--probabilities", "-o", str(tmp_path / "pb.csv"))
    assert r.returncode == 0 and (tmp_path / "pj.csv").read_bytes() == (tmp_path / "pb.csv").read_bytes(), r.stderr
    # '-': a CSV piped in, as `storage cp -` reads one; nothing piped, or no CSV, says what to pipe
    piped = lambda data: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", "digits", "-"],  # noqa: E731
                                        input=data, capture_output=True, text=True, timeout=300)
    r = piped(shuffled.head(40).to_csv(index=False))
    assert r.returncode == 0 and (pd.read_csv(io.StringIO(r.stdout))["prediction"].to_numpy() == expected[:40]).all()
    assert "40 rows predicted by digits" in r.stderr, r.stderr
    for data, needle in (("", "stdin holds no table (nothing was piped in)"),
                         ('a,b\n1,"x\n', "cannot parse stdin as CSV: Error tokenizing data")):
        r = piped(data)
        assert r.returncode == 2 and needle in r.stderr and "hint: pipe a CSV with a header row" in r.stderr, r.stderr
    # the endpoint as `serve list` prints it, or with a trailing '/': the server's URL is taken from it
    # (the requests' path was doubled: a bare 404)
    for given in (endpoint.infer_url, endpoint.url + "/"):
        r = cli("digits", str(tmp_path / "rows.csv"), "--url", given, "-o", str(tmp_path / "p2.csv"))
        assert r.returncode == 0 and f"rows predicted by digits at {endpoint.url};" in r.stderr, r.stderr
    r = cli("other", str(tmp_path / "rows.csv"), "--url", endpoint.infer_url)
    assert r.returncode == 1 and f"--url '{endpoint.infer_url}' is the endpoint of the model 'digits', not of " \
                                 "'other'" in r.stderr, r.stderr
    # a label column with empty cells (pandas reads its ids as floats: 3.0): the labelled rows are
    # scored as ids, the others are not counted
    shuffled.assign(label=shuffled["label"].where(shuffled.index >= 10)).to_csv(tmp_path / "gaps.csv", index=False)
    r = cli("digits", str(tmp_path / "gaps.csv"), "-o", str(tmp_path / "g.csv"))
    labelled = float((expected[10:] == truth[10:]).mean())
    assert r.returncode == 0 and (f"accuracy against 'label': {labelled:.4f} on the {len(table) - 10} labelled rows "
                                  "(10 without a label)") in r.stderr, r.stderr
    written = pd.read_csv(tmp_path / "g.csv")
    assert written["label"][:10].isna().all() and (written["label"][10:] == truth[10:]).all()
    pd.DataFrame({**{f: table[f][:3] for f in features}, "label": [np.nan] * 3}).to_csv(tmp_path / "none.csv", index=False)
    r = cli("digits", str(tmp_path / "none.csv"))
    assert r.returncode == 0 and "3 rows predicted" in r.stderr and "no row has a 'label' to score against" in r.stderr
    table[features].head(7).to_csv(tmp_path / "plain.csv", index=False)
    r = cli("digits", str(tmp_path / "plain.csv"), "--url", endpoint.url, "--probabilities", "-o", "-")  # '-': stdout
    probs = pd.read_csv(io.StringIO(r.stdout))  # a model of class ids: a column per id
    assert r.returncode == 0 and list(probs.columns) == ["row", "prediction", "confidence", *(f"p_{c}" for c in range(10))]
    assert (probs[[f"p_{c}" for c in range(10)]].to_numpy().argmax(axis=1) == expected[:7]).all()
    # a missing feature column, a value that is not a number, a server that is not there: one clear line each
    shuffled.drop(columns=["pixel_0_3", "pixel_7_7"]).to_csv(tmp_path / "short.csv", index=False)
    r = cli("digits", str(tmp_path / "short.csv"))
    assert r.returncode == 2 and "lacks 2 of the model's 64 feature columns: ['pixel_0_3', 'pixel_7_7']" in r.stderr
    assert "did you mean" not in r.stderr  # nothing it has is near them
    # a column renamed in another case or spacing is named beside the one it stands for
    shuffled.rename(columns={"pixel_0_3": "Pixel_0_3", "pixel_7_7": "pixel 7 7"}).to_csv(tmp_path / "renamed.csv", index=False)
    r = cli("digits", str(tmp_path / "renamed.csv"))
    assert r.returncode == 2 and ("lacks 2 of the model's 64 feature columns: ['pixel_0_3', 'pixel_7_7']; did you mean "
                                  "'Pixel_0_3' for 'pixel_0_3', 'pixel 7 7' for 'pixel_7_7'?") in r.stderr, r.stderr
    # the same image's pixels numbered as Kaggle's CSVs have them: named as an image, not column by
    # column ('pixel10' looks like 'pixel_1_0' but is the model's 'pixel_1_2')
    kaggle = table[features].set_axis([f"pixel{i}" for i in range(64)], axis=1).assign(label=table["label"])
    kaggle.to_csv(tmp_path / "kaggle.csv", index=False)
    r = cli("digits", str(tmp_path / "kaggle.csv"))
    assert r.returncode == 2 and ("lacks 64 of the model's 64 feature columns: ['pixel_0_0', 'pixel_0_1', 'pixel_0_2', "
                                  "'pixel_0_3', 'pixel_0_4', 'pixel_0_5', 'pixel_0_6', 'pixel_0_7'] ...; the table's "
                                  "columns pixel0 ... pixel63 are the 8x8 image's pixels named otherwise (the model's: "
                                  "pixel_0_0 ... pixel_7_7); rename them in row-major order ('pixel9' is the model's "
                                  "'pixel_1_1')") in r.stderr, r.stderr
    assert "did you mean" not in r.stderr and "Traceback" not in r.stderr
    bad = table.astype({"pixel_2_2": object, "pixel_1_1": object})
    bad.loc[4, "pixel_2_2"] = "n/a"  # pandas reads it as NaN
    bad.to_csv(tmp_path / "bad.csv", index=False)
    r = cli("digits", str(tmp_path / "bad.csv"))
    assert r.returncode == 2 and "1 feature value(s) are empty, NaN or infinite: row 5 'pixel_2_2'" in r.stderr, r.stderr
    bad.loc[9, "pixel_1_1"] = "twelve"
    bad.to_csv(tmp_path / "bad.csv", index=False)
    r = cli("digits", str(tmp_path / "bad.csv"))
    assert r.returncode == 2 and "feature column 'pixel_1_1' is not numeric (row 10: 'twelve')" in r.stderr, r.stderr
    r = cli("nothere", str(tmp_path / "plain.csv"))
    assert r.returncode == 1 and "no local model server named 'nothere'" in r.stderr and "--url" in r.stderr
    assert "`kfp-pytorch serve start nothere --model-uri models:/nothere@champion` serves a registered" in r.stderr
    r = cli("digts", str(tmp_path / "plain.csv"))  # a slip of the name: the server meant is named
    assert r.returncode == 1 and "no local model server named 'digts'; did you mean 'digits'?" in r.stderr, r.stderr
    # an output that cannot be written is refused before a row is sent (even to a server not there);
    # a table that is not there names the argument it was given by
    r = cli("nothere", str(tmp_path / "plain.csv"), "-o", str(tmp_path / "no-such-dir" / "p.csv"))
    assert r.returncode == 2 and f"-o/--output: directory '{tmp_path / 'no-such-dir'}' does not exist" in r.stderr
    assert "no local model server" not in r.stderr and not (tmp_path / "no-such-dir").exists()
    r = cli("digits", str(tmp_path / "gone.csv"))
    assert r.returncode == 2 and "dataset not found" in r.stderr and "hint: check TABLE;" in r.stderr, r.stderr
    # through an ingress gateway that routes by Host, as Istio does for KServe (404 for any other host)
    from http.server import BaseHTTPRequestHandler

    from servers import forward, reply, serve_in_thread, stop_http

    class Gateway(BaseHTTPRequestHandler):
        metadata = True  # False: a server that declares no inputs by name (the model metadata is a 404)

        def do_GET(self):
            self.do_POST()

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"])) if self.command == "POST" else None
            if self.headers["Host"] != "digits.team-a.example.com":
                return reply(self, 404, b"", "text/plain")
            if self.headers.get("Authorization") != "Bearer t0ken":  # Kubeflow's oauth2-proxy
                self.send_response(302)
                self.send_header("Location", "/oauth2/start?rd=/v2/models/digits/infer")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.command == "GET" and not Gateway.metadata:
                return reply(self, 404, b"", "text/plain")
            forward(self, endpoint.url, body)

        def log_message(self, *a):
            pass

    gw, gw_url = serve_in_thread(Gateway)
    try:
        r = cli("digits", str(tmp_path / "plain.csv"), "--url", gw_url, "--host-header", "digits.team-a.example.com")
        assert r.returncode == 1 and "requires authentication (HTTP 302, to /oauth2/start" in r.stderr, r.stderr
        assert "pass --token (or KFP_PYTORCH_SERVE_TOKEN)" in r.stderr
        gateway = ("--url", gw_url, "--host-header", "digits.team-a.example.com", "--token", "t0ken")
        r = cli("digits", str(tmp_path / "rows.csv"), *gateway)  # the model metadata goes through it too
        assert r.returncode == 0, r.stderr
        assert (pd.read_csv(io.StringIO(r.stdout))["prediction"].to_numpy() == expected).all()
        r = cli("digits", str(tmp_path / "plain.csv"), "--url", gw_url)
        assert r.returncode == 1 and "HTTP 404" in r.stderr
        # a table without the features' names: refused by name, never sent
        table[features].head(3).set_axis(range(64), axis=1).to_csv(tmp_path / "numbered.csv", index=False)
        r = cli("digits", str(tmp_path / "numbered.csv"), *gateway)
        assert r.returncode == 2 and "lacks 64 of the model's 64 feature columns: ['pixel_0_0'," in r.stderr, r.stderr
        # a server that declares no names: the table's columns in order, and of the wrong count the
        # server's refusal, with the rows it concerns
        Gateway.metadata = False
        r = cli("digits", str(tmp_path / "plain.csv"), *gateway)
        assert r.returncode == 0, r.stderr
        assert (pd.read_csv(io.StringIO(r.stdout))["prediction"].to_numpy() == expected[:7]).all()
        table[features[:10]].head(3).to_csv(tmp_path / "narrow.csv", index=False)
        r = cli("digits", str(tmp_path / "narrow.csv"), *gateway)
        assert r.returncode == 1 and "rows 1-3: inference request failed: HTTP 400" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    finally:
        stop_http(gw)
    r = cli("digits", str(tmp_path / "plain.csv"), "--host-header", "digits.team-a.example.com")
    assert r.returncode == 1 and "--host-header goes with --url" in r.stderr


def complete(line: str, shell: str = "bash_complete") -> list[str]:
    """What the shell's TAB completes at the end of ``line`` (click's protocol, as its script asks)."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli"], capture_output=True, text=True, env={
        **os.environ, "_KFP_PYTORCH_COMPLETE": shell, "COMP_WORDS": line, "COMP_CWORD": str(len(line.split(" ")) - 1)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout.splitlines()


def test_server_is_listed_and_stopped(endpoint):
    from kfp_pytorch.components.serve import _write_record

    [info] = [s for s in list_servers() if s["name"] == "digits"]
    assert info["alive"] and info["pid"] == endpoint.pid
    # TAB completes the servers' names, the ones that are down first where they are started
    _write_record("digits-old", {"name": "digits-old", "url": "http://127.0.0.1:1", "pid": None,
                                 "infer_url": "http://127.0.0.1:1/v2/models/digits-old/infer", "model_uri": "/gone"})
    try:
        assert complete("kfp-pytorch serve stop dig") == ["plain,digits", "plain,digits-old"]
        assert complete("kfp-pytorch serve start dig") == ["plain,digits-old", "plain,digits"]
        assert complete("kfp-pytorch serve stop digits ") == ["plain,digits-old"]  # not one named already
        assert complete("kfp-pytorch serve logs digits-") == ["plain,digits-old"]
        assert complete("kfp-pytorch serve predict digits rows.c") == ["file,rows.c"]  # the table: a file name
        assert "plain\ndigits\nup " + endpoint.infer_url in "\n".join(
            complete("kfp-pytorch serve logs d", "zsh_complete"))  # zsh shows each one's state
    finally:
        stop_server("digits-old")
    assert stop_server("digits")
    assert not psutil.pid_exists(endpoint.pid) or psutil.Process(endpoint.pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{endpoint.url}/v2/health/ready", timeout=2)


def test_an_unreadable_record_is_listed_and_removed_and_stop_all_stops_every_server(endpoint):
    import subprocess
    import sys

    from kfp_pytorch.components.serve import _pidfile

    _pidfile("broken").write_text('{"name": "broken", "pi')  # half-written: `serve list` was a traceback
    cli = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", *a],  # noqa: E731
                                    capture_output=True, text=True)
    r = cli("list")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    header, *rest = r.stdout.splitlines()
    assert header.split() == ["NAME", "PID", "STATUS", "URL", "MODEL"]  # each column named, as kubectl get's
    lines = dict(line.split(None, 1) for line in rest)
    assert re.match(r"-\s+\?\s+\(unreadable record ", lines["broken"])
    assert re.match(rf"{endpoint.pid}\s+up \d+s\s+{re.escape(endpoint.infer_url)}\s", lines["digits"])  # and for how long
    assert lines["digits"].endswith(f"   {endpoint.model_uri}")
    # the columns line up under the header, whatever a name's length
    assert {line.index("http") for line in r.stdout.splitlines() if "http" in line} == {header.index("URL")}
    [listed] = [s for s in json.loads(cli("list", "--json").stdout) if s["name"] == "digits"]
    assert listed["pid"] == endpoint.pid and listed["alive"] is True and listed["infer_url"] == endpoint.infer_url
    assert 0 < listed["uptime_s"] < 600
    r = cli("stop", "broken", "nothere")
    assert r.returncode == 1 and "stopped broken" in r.stdout
    assert "no local model server named 'nothere'; the servers: digits" in r.stderr, r.stderr
    r = cli("stop", "digts")
    assert r.returncode == 1 and "no local model server named 'digts'; did you mean 'digits'?" in r.stderr, r.stderr
    assert cli("stop").returncode == 2 and cli("stop", "digits", "--all").returncode == 2
    r = cli("stop", "--all")
    assert r.returncode == 0 and r.stdout == "stopped digits\n", r.stdout + r.stderr
    assert not list_servers() and cli("stop", "--all").stdout == "no local model servers\n"


def test_a_server_that_died_is_started_again_with_its_model_on_its_port(endpoint, tmp_path):
    import os
    import subprocess
    import sys

    from kfp_pytorch.components.serve import _write_record, keep_champion_served, revive

    cli = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", *a],  # noqa: E731
                                    capture_output=True, text=True)
    row = [read_metadata(endpoint.model_uri)["normalization"]["mean"]]
    answer = infer(endpoint.url, "digits", row)["outputs"]
    assert revive("digits") == (revive("digits")[0], False)  # up: left as it is
    assert keep_champion_served("digits") == f"which stays served at {endpoint.infer_url}"
    psutil.Process(endpoint.pid).kill()  # a crash, or a reboot
    psutil.Process(endpoint.pid).wait(10)
    [down] = [s for s in list_servers() if s["name"] == "digits"]
    assert down["alive"] is False
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", "digits", "sample://digits"],
                       capture_output=True, text=True)  # was "rows 1-1797: could not reach the model server"
    assert r.returncode == 1 and f"the local model server 'digits' is down (its process {endpoint.pid} is gone" in r.stderr
    assert "hint: `kfp-pytorch serve start digits` starts it again with its model" in r.stderr
    listed = cli("list").stdout.splitlines()
    assert listed[1].split()[:3] == ["digits", str(endpoint.pid), "down"] and listed[-1] == ("1 down: `kfp-pytorch serve start digits` starts it again with its "
                                                   "model; `serve stop` removes the record")
    died = cli("logs", "digits").stdout
    assert "Uvicorn running on" in died or "Started server process" in died, died[-2000:]
    r = cli("start", "--all")
    assert r.returncode == 0, r.stderr
    assert cli("logs", "digits", "--previous").stdout == died  # the dead server's log, kept as the previous one
    assert len(cli("logs", "digits", "--tail", "2").stdout.splitlines()) == 2
    [up] = [s for s in list_servers() if s["name"] == "digits"]
    assert up["alive"] and up["pid"] != endpoint.pid and up["infer_url"] == endpoint.infer_url  # its old port
    assert up["model_uri"] == endpoint.model_uri
    assert r.stdout == f"digits: started at {endpoint.infer_url} (pid {up['pid']})\n"
    assert infer(endpoint.url, "digits", row)["outputs"] == answer  # the same model answers
    assert cli("start", "--all").stdout == "every local model server is up\n"
    # the serve step of a run that did not beat the champion starts the champion's server again
    psutil.Process(up["pid"]).kill()
    psutil.Process(up["pid"]).wait(10)
    note = keep_champion_served("digits")
    [again] = [s for s in list_servers() if s["name"] == "digits"]
    assert again["alive"] and note == f"whose local server was down; it serves again at {endpoint.infer_url} (pid {again['pid']})"
    # a model that is gone, and a name with no server, say so; a name given twice is not a usage error
    _write_record("gone", {"name": "gone", "url": "http://127.0.0.1:1", "infer_url": "http://127.0.0.1:1/v2/models/gone/infer",
                           "pid": None, "model_uri": str(tmp_path / "pruned" / "model")})
    r = cli("start", "gone", "nothere", "digits")
    assert r.returncode == 1 and r.stdout == f"digits: already up at {endpoint.infer_url} (pid {again['pid']})\n"
    assert f"gone: the model that 'gone' served is gone: {tmp_path / 'pruned' / 'model'}" in r.stderr
    assert "nothere: no local model server named 'nothere' to start again" in r.stderr
    assert "kfp-pytorch serve start nothere --model-uri models:/nothere@champion" in r.stderr
    assert "Error: could not start 'gone', 'nothere'" in r.stderr
    assert keep_champion_served("gone").startswith("whose local server is down and cannot start again: the model")
    assert keep_champion_served("nothere").startswith("and no local server serves it here")
    assert cli("start").returncode == 2 and cli("start", "digits", "--all").returncode == 2
    r = cli("logs", "nothere")
    assert r.returncode == 1 and "no log for a local model server named 'nothere'" in r.stderr
    r = cli("logs", "digts")
    assert r.returncode == 1 and "did you mean 'digits'?" in r.stderr, r.stderr
    r = cli("start", "digts")
    assert r.returncode == 1 and "digts: no local model server named 'digts' to start again; did you mean 'digits'?" in r.stderr
    stop_server("gone")
    # its old port taken while it was down: it starts on a free one, and says its URL changed
    import socket
    from urllib.parse import urlsplit

    psutil.Process(again["pid"]).kill()
    psutil.Process(again["pid"]).wait(10)
    old_port = urlsplit(endpoint.url).port
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the killed server's connections linger
        squatter.bind(("127.0.0.1", old_port))
        squatter.listen()
        r = cli("start", "digits", "--port", str(old_port))  # the port asked for is taken: said in the CLI's words
        assert r.returncode == 1 and f"already in use by pid {os.getpid()} (" in r.stderr, r.stderr
        assert "hint: give another --port (--port 0: a free one)" in r.stderr and "port=0" not in r.stderr
        # a start that failed keeps the dead server's record: still listed down, still to start again
        assert [s["alive"] for s in list_servers() if s["name"] == "digits"] == [False]
        r = cli("start", "digits")
    [moved] = [s for s in list_servers() if s["name"] == "digits"]
    assert r.returncode == 0 and moved["alive"] and urlsplit(moved["url"]).port != old_port, r.stderr
    assert r.stdout == (f"digits: started at {moved['infer_url']} (pid {moved['pid']}) (its old port {old_port} is "
                        "taken by another process: clients of the old URL must change)\n")
    psutil.Process(moved["pid"]).kill()  # back where the other tests expect it
    psutil.Process(moved["pid"]).wait(10)
    r = cli("start", "digits", "--port", str(old_port))
    assert r.returncode == 0 and r.stdout.startswith(f"digits: started at {endpoint.infer_url} ") and "old port" not in r.stdout


def test_serve_logs_follow_goes_on_through_a_redeploy_and_ends_when_the_server_stops(endpoint):
    # as `kubectl logs -f`: a server's requests as they come, the redeployed server's log under the
    # same name, and an end once the server is stopped (there was only the log as it was)
    import subprocess
    import sys
    import threading
    import time

    follow = subprocess.Popen([sys.executable, "-m", "kfp_pytorch.cli", "serve", "logs", "digits", "-f", "--tail", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(follow.stdout), daemon=True).start()  # each line as it comes

    def read_until(needle, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in list(seen)):
            assert time.monotonic() < deadline, f"{needle!r} not followed: {seen[-5:]}"
            time.sleep(0.1)

    try:
        row = [read_metadata(endpoint.model_uri)["normalization"]["mean"]]
        time.sleep(1.0)  # the follower has printed the tail and is waiting for more
        infer(endpoint.url, "digits", row)
        read_until('"POST /v2/models/digits/infer HTTP/1.1" 200')  # a request after it started
        again = serve(ServeSpec(endpoint.model_uri, "digits"))  # a redeploy: the same name, a new process
        assert again.pid != endpoint.pid
        read_until(f"Started server process [{again.pid}]")
        infer(again.url, "digits", row)
        read_until(f"{again.pid} - \"POST /v2/models/digits/infer")
        stop_server("digits")
        assert follow.wait(timeout=20) == 0
        err = follow.stderr.read()
        assert "digits was redeployed: the new server's log follows" in err
        assert err.rstrip().endswith("digits was stopped (serve stop): its log ends here") and "Traceback" not in err
        assert not any("ORJSONResponse is deprecated" in line for line in seen)  # KServe's, nothing to act on
    finally:
        follow.kill()
        follow.wait()
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "logs", "digits", "-f", "--previous"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "leave out --follow" in r.stderr


def test_serve_logs_follow_waits_out_a_deploy_under_way_however_long_the_server_is_down(tmp_path):
    # A redeploy stops the old server before its successor serves, and records the successor only
    # then: on a loaded machine that took longer than the follower's grace, and it ended before the
    # new server's log. While a deploy of the name holds its lock, a down server is not gone.
    import subprocess
    import sys
    import threading
    import time

    from kfp_pytorch.components.paths import locked
    from kfp_pytorch.components.processes import start_ticks
    from kfp_pytorch.components.serve import _write_record, deploy_lock, follow_log

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_record("held", {"name": "held", "pid": server.pid, "start_ticks": start_ticks(server.pid),
                               "infer_url": "http://127.0.0.1:1/v2/models/held/infer"})
        server_log("held").write_text("the old server's line\n")
        events: list[tuple[str, str]] = []
        follower = threading.Thread(target=lambda: events.extend(follow_log("held", poll_s=0.05, grace_s=0.3)))
        with locked(deploy_lock("held")):  # a deploy of "held" is under way
            follower.start()
            deadline = time.monotonic() + 30

            def wait_for(seen):
                while not seen():
                    assert time.monotonic() < deadline and follower.is_alive(), events
                    time.sleep(0.02)

            wait_for(lambda: events)  # the log as it was, read
            with server_log("held").open("a") as log:  # a line it follows: it has seen the server alive
                log.write("a request\n")
            wait_for(lambda: ("log", "a request\n") in events)
            server.kill()
            server.wait(10)
            time.sleep(1.5)  # five graces down
            assert follower.is_alive(), events
        follower.join(10)
        assert not follower.is_alive()  # the deploy is over and the server still down: the log ends
        assert events == [("log", "the old server's line\n"), ("log", "a request\n"),
                          ("note", "held's server is down (pid %d is gone): its log ends here; "
                                   "`kfp-pytorch serve start held` starts it again" % server.pid)]
    finally:
        server.kill()
        server.wait(10)


def test_port_in_use_is_a_clear_error_that_names_who_holds_the_port(trained_model, endpoint):
    import os
    from urllib.parse import urlsplit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError) as e:
            serve(ServeSpec(trained_model.model_uri, "busy", port=port))
        assert e.value.message.startswith(f"port {port} on 127.0.0.1 is already in use by pid {os.getpid()} (")
        assert "port=0" in e.value.hint
    taken = urlsplit(endpoint.url).port  # another local model server's port: named, with how to stop it
    with pytest.raises(PortInUseError) as e:
        serve(ServeSpec(trained_model.model_uri, "busy", port=taken))
    assert e.value.message == (f"port {taken} on 127.0.0.1 is already in use by the local model server 'digits' "
                               "(`kfp-pytorch serve stop digits` stops it)")
    assert not [s for s in list_servers() if s["name"] == "busy"]


def test_a_model_that_does_not_load_fails_fast_without_orphans(trained_model, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ServingError, match="exited"):
        serve(ServeSpec(_broken_model(trained_model.model_uri, tmp_path / "broken"), "ghost"))
    after = {p.pid for p in psutil.Process().children(recursive=True) if _running(p)}
    assert after <= before


def _running(p: psutil.Process) -> bool:
    """Alive and not a zombie; a child reaped while it is listed (an earlier test's stopped server) is not."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_serving_from_s3(s3, bucket, trained_model):
    s3.upload_dir(trained_model.model_uri, f"s3://{bucket}/model")
    ep = serve(ServeSpec(f"s3://{bucket}/model", "from-s3"))
    try:
        resp = infer(ep.url, "from-s3", [[0.0] * 64])
        assert len(resp["outputs"][1]["data"]) == 1
    finally:
        stop_server("from-s3")


def test_serve_validates_settings(trained_model):
    with pytest.raises(ConfigError) as e:
        serve(ServeSpec(trained_model.model_uri, "Bad_Name", port=70000, registered_model="models:/digits@champion"))
    assert "model_name" in str(e.value) and "port" in str(e.value)
    assert "registered_model: must be a registered version, models:/NAME/VERSION, got 'models:/digits@champion'" in str(
        e.value)


def test_a_bad_thread_count_stops_the_predictor_with_its_name(trained_model):
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.components.kserve_predictor", "--model_name", "x",
                        "--model_uri", trained_model.model_uri], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KFP_PYTORCH_SERVE_THREADS": "two"})
    assert r.returncode == 2 and "KFP_PYTORCH_SERVE_THREADS: must be an integer >= 1, got 'two'" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_uri_that_holds_no_trained_model_is_named_before_anything_loads_or_starts(digits_data, tmp_path):
    # a dataset, a file or nothing given for the model: evaluate and register failed with a bare
    # "read .../metadata.json: no such file", and a local server started, then died with a traceback
    from kfp_pytorch.components.errors import ModelNotFound
    from kfp_pytorch.components.evaluate import EvaluateSpec, evaluate
    from kfp_pytorch.components.register import RegisterSpec, register
    from kfp_pytorch.components.serve import ServeSpec, list_servers, serve

    table = tmp_path / "rows.csv"
    table.write_text("a,label\n1,0\n")
    cases = {str(tmp_path / "none"): "metadata.json missing",
             str(table): "it is a file; a trained model is a folder: model.pt2 and metadata.json",
             digits_data: "it is a prepared dataset"}
    for uri, there in cases.items():
        for step in (lambda: evaluate(EvaluateSpec(digits_data, uri)),
                     lambda: register(RegisterSpec(uri, "digits", {"accuracy": 0.95}, True)),
                     lambda: serve(ServeSpec(uri, "digits"))):
            with pytest.raises(ModelNotFound) as e:
                step()
            assert e.value.message == f"no trained model at {uri} ({there})"
            assert e.value.hint == "point model_uri at the model/ directory written by train (train_op's model output)"
    assert list_servers() == []  # no server was started to fail
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", "digits", "sample://digits",
                        "--url", "http://127.0.0.1:9", "--model-uri", f"{digits_data}/model"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"no trained model at {digits_data}/model (metadata.json missing)" in r.stderr
    assert "hint: give --model-uri a run's train-op.model directory" in r.stderr and "Traceback" not in r.stderr


def test_trains_output_folder_given_for_its_model_names_the_model_folder(digits_data, trained_model):
    # train's output_uri (checkpoints/, history.json, model/) given for the model: "metadata.json
    # missing" left the user to guess, and `serve predict --model-uri` alone took it (and showed a
    # dataset as ".../model": metadata.json missing)
    import subprocess
    import sys

    from kfp_pytorch.components.errors import ModelNotFound
    from kfp_pytorch.components.evaluate import EvaluateSpec, evaluate
    from kfp_pytorch.components.serve import ServeSpec, list_servers, serve

    root = trained_model.model_uri.rsplit("/", 1)[0]
    says = f"no trained model at {root} (it is train's output folder: its model is {root}/model)"
    for step in (lambda: evaluate(EvaluateSpec(digits_data, root)), lambda: serve(ServeSpec(root, "digits"))):
        with pytest.raises(ModelNotFound) as e:
            step()
        assert e.value.message == says
    assert list_servers() == []
    for args in (["serve", "start", "digits", "--model-uri", root],
                 ["serve", "predict", "digits", "sample://digits", "--url", "http://127.0.0.1:9", "--model-uri", root]):
        r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", "digits", "sample://digits",
                        "--url", "http://127.0.0.1:9", "--model-uri", digits_data], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and f"no trained model at {digits_data} (it is a prepared dataset)" in r.stderr


def test_serve_start_model_uri_says_which_names_it_was_given_when_it_needs_one(tmp_path):
    # "give one NAME, not --all" was said also to a command with no --all: with no name, or two
    from click.testing import CliRunner

    from kfp_pytorch.cli import cli

    for names, said in [([], "none was given"), (["a", "b"], "not 2: a b"), (["--all"], "not --all")]:
        r = CliRunner().invoke(cli, ["serve", "start", *names, "--model-uri", str(tmp_path)], prog_name="kfp-pytorch")
        assert r.exit_code == 2, r.output
        assert f"--model-uri serves one model: give one NAME (the endpoint's name), {said}" in r.output


def test_a_predictor_without_its_model_says_so_in_its_log_not_a_traceback(tmp_path):
    # an InferenceService whose storage initializer fetched nothing: the container log is what
    # `kubectl logs` shows the user
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.components.kserve_predictor", "--model_name", "x",
                        "--model_uri", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"Error: no trained model at {tmp_path} (metadata.json missing)" in r.stderr
    assert "hint: point model_uri at the model/ directory written by train" in r.stderr
    table = tmp_path / "model.csv"  # a file for the folder: no NotADirectoryError traceback either
    table.write_text("a\n1\n")
    r = subprocess.run([sys.executable, "-m", "kfp_pytorch.components.kserve_predictor", "--model_name", "x",
                        "--model_uri", str(table)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"Error: no trained model at {table} (it is a file; a trained model is a folder" in r.stderr
    # KServe's own layout: no --model_uri and no STORAGE_URI, so /mnt/models, which the storage
    # initializer was to fill; the hint points at it rather than at train
    import os
    if not os.path.exists("/mnt/models/metadata.json"):
        env = {k: v for k, v in os.environ.items() if k != "STORAGE_URI"}
        r = subprocess.run([sys.executable, "-m", "kfp_pytorch.components.kserve_predictor", "--model_name", "x"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert "Error: no trained model at /mnt/models" in r.stderr, r.stderr
        assert "KServe's storage initializer fills /mnt/models from STORAGE_URI" in r.stderr
        assert "kubectl logs POD -c storage-initializer" in r.stderr


def test_a_text_label_column_is_trained_evaluated_and_served_by_name(tmp_path):
    from kfp_pytorch.components.evaluate import EvaluateSpec, evaluate
    from kfp_pytorch.components.prepare_data import PrepareSpec, load_table, prepare_data
    from kfp_pytorch.components.train import TrainSpec, train

    table = load_table("sample://digits")
    table = table[table["label"] < 3].reset_index(drop=True)
    table["label"] = table["label"].map({0: "zero", 1: "one", 2: "two"})  # as iris' species, say
    table.to_csv(tmp_path / "named.csv", index=False)
    meta = prepare_data(PrepareSpec(str(tmp_path / "named.csv"), str(tmp_path / "data")))
    assert meta["class_names"] == ["one", "two", "zero"] and meta["classes"] == [0, 1, 2]
    model = train(TrainSpec(str(tmp_path / "data"), str(tmp_path / "run"), epochs=4, progress="off")).model_uri
    res = evaluate(EvaluateSpec(str(tmp_path / "data"), model, threshold=0.5))
    assert res["class_names"] == ["one", "two", "zero"] and res["metrics"]["accuracy"] > 0.8
    ep = serve(ServeSpec(model, "named"))
    try:
        rows = table.drop(columns=["label"]).to_numpy(dtype=np.float32)[:20]
        out = {o["name"]: o for o in infer(ep.url, "named", rows.tolist())["outputs"]}
        assert out["class"]["datatype"] == "BYTES" and len(out["class"]["data"]) == 20
        # names as the binary extension carries BYTES (each one length-prefixed) read back the same
        assert infer(ep.url, "named", rows, binary=True)["outputs"] == infer(ep.url, "named", rows.tolist())["outputs"]
        assert out["class"]["data"] == [meta["class_names"][i] for i in out["label"]["data"]]
        assert np.mean(np.asarray(out["class"]["data"]) == table["label"].to_numpy()[:20]) > 0.8
        outputs = requests.get(f"{ep.url}/v2/models/named").json()["outputs"]
        assert [(o["name"], o["datatype"], o["shape"]) for o in outputs] == [
            ("probabilities", "FP32", [-1, 3]), ("label", "INT64", [-1]), ("class", "BYTES", [-1])]
        v1 = requests.post(f"{ep.url}/v1/models/named:predict", json={"instances": rows[:2].tolist()}).json()
        assert v1["predictions"] == out["class"]["data"][:2]
        # a whole table: predictions by class name, scored against the table's own text labels
        from kfp_pytorch.components.batch_predict import predict_table, resolve_target

        scored = predict_table(resolve_target("named"), table.head(50), batch_size=16)
        preds, accuracy = scored.frame, scored.accuracy
        assert scored.unknown_labels == {} and scored.model_classes == sorted(set(table["label"]))
        assert list(preds["prediction"][:20]) == out["class"]["data"] and list(preds["label"]) == list(table["label"][:50])
        assert accuracy == pytest.approx(float(np.mean(preds["prediction"] == preds["label"]))) and accuracy > 0.8
    finally:
        stop_server("named")


def test_labels_of_another_preparation_are_matched_by_name():
    from kfp_pytorch.components.errors import DatasetError
    from kfp_pytorch.components.evaluate import EvaluateSpec, to_model_labels

    spec = EvaluateSpec("s3://data/fresh", "s3://models/m/model")
    # the model numbered [cat, dog]; fresh data, with a bird, numbers [bird, cat, dog]
    y, names = to_model_labels(np.array([0, 1, 2, 2]), {"class_names": ["bird", "cat", "dog"]},
                               {"class_names": ["cat", "dog"]}, spec)
    assert names == ["cat", "dog", "bird"] and y.tolist() == [2, 0, 1, 1]
    assert to_model_labels(np.array([1, 0]), {}, {}, spec)[0].tolist() == [1, 0]
    with pytest.raises(DatasetError, match="labels classes by name and the model at s3://models/m/model by id"):
        to_model_labels(np.array([0]), {"class_names": ["cat"]}, {"class_names": None}, spec)


def test_a_request_istios_authorization_refuses_says_so_and_what_allows_it():
    # In a Kubeflow profile namespace the predictor has Istio's sidecar, and the profile's
    # AuthorizationPolicy refuses a caller it does not know (the serve step's pod is outside the
    # mesh) with Envoy's 403: that said "requires authentication: pass --token", which no token fixes
    from http.server import BaseHTTPRequestHandler

    from kfp_pytorch.components.errors import ServingError
    from kfp_pytorch.components.serve import infer
    from servers import reply, serve_in_thread, stop_http

    class Sidecar(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            reply(self, 403, b"RBAC: access denied", "text/plain")

        def log_message(self, *a):
            pass

    srv, url = serve_in_thread(Sidecar)
    try:
        with pytest.raises(ServingError) as e:
            infer(url, "digits", [[0.0] * 64])
    finally:
        stop_http(srv)
    assert e.value.message == (f"Istio refused the request at {url} (HTTP 403 RBAC: access denied): no "
                               "AuthorizationPolicy of the model's namespace allows this caller"), e.value.message
    assert e.value.hint.startswith("allow it with an AuthorizationPolicy on the predictor"), e.value.hint


def test_a_scored_tables_label_column_is_typed_as_its_predictions(endpoint, trained_model):
    import pandas as pd

    from kfp_pytorch.components.batch_predict import predict_table, resolve_target
    from kfp_pytorch.components.prepare_data import load_table

    table = load_table("sample://digits").head(20)
    table["label"] = table["label"].where(table.index >= 2)  # two rows without a label: the ids read as floats
    scored = predict_table(resolve_target("digits"), table)
    preds, accuracy = scored.frame, scored.accuracy
    assert str(preds["label"].dtype) == "Int64" and preds["label"][:2].isna().all()
    assert accuracy == pytest.approx((preds["prediction"][2:] == preds["label"][2:]).mean())  # comparable as they are
    assert pd.isna(predict_table(resolve_target("digits"), table.assign(label=np.nan)).accuracy)
    # pandas' nullable columns (a Parquet file's Int64 ids, its text): a gap is no label, not a class named '<NA>'
    for nullable in ("Int64", "string"):
        labels = table["label"].astype("Int64").astype(nullable)
        again = predict_table(resolve_target("digits"), table.assign(label=labels))
        assert again.unknown_labels == {} and again.accuracy == accuracy, again.unknown_labels
        pd.testing.assert_series_equal(again.frame["label"], preds["label"])


def test_labels_that_are_no_class_of_the_model_are_said_and_never_scored_as_its_mistakes(endpoint, trained_model,
                                                                                         tmp_path):
    import subprocess
    import sys

    from kfp_pytorch.components.batch_predict import predict_table, resolve_target
    from kfp_pytorch.components.prepare_data import load_table

    table = load_table("sample://digits").head(30)
    model = predict_table(resolve_target("digits"), table)
    assert model.model_classes == [str(c) for c in range(10)] and model.unknown_labels == {}
    # the classes named as words: no label is a class of a model of ids, and accuracy 0 was printed
    words = "zero one two three four five six seven eight nine".split()
    named = predict_table(resolve_target("digits"), table.assign(label=table["label"].map(dict(enumerate(words)))))
    assert named.accuracy is None and sum(named.unknown_labels.values()) == 30
    assert named.unknown_labels["zero"] == int((table["label"] == 0).sum())
    # a few rows of an id the model never learnt: said, and counted wrong (no prediction can match them)
    odd = table.assign(label=table["label"].where(table.index >= 4, 42))
    some = predict_table(resolve_target("digits"), odd)
    assert some.unknown_labels == {"42": 4}
    assert some.accuracy == pytest.approx(float((some.frame["prediction"] == some.frame["label"]).mean()))
    assert some.accuracy <= 26 / 30

    cli = lambda t: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", "digits", t,  # noqa: E731
                                    "-o", str(tmp_path / "p.csv")], capture_output=True, text=True, timeout=300)
    table.assign(label=table["label"].map(dict(enumerate(words)))).to_csv(tmp_path / "words.csv", index=False)
    r = cli(str(tmp_path / "words.csv"))
    assert r.returncode == 0 and "accuracy" not in r.stderr, r.stderr
    assert "not scored: no 'label' in the table is a class of the model (the table's: 'zero' (" in r.stderr
    assert "the model's: 0, 1, 2, 3, 4, 5 and 4 more)" in r.stderr
    odd.to_csv(tmp_path / "odd.csv", index=False)
    r = cli(str(tmp_path / "odd.csv"))
    assert r.returncode == 0 and f"accuracy against 'label': {some.accuracy:.4f}" in r.stderr, r.stderr
    assert "4 row(s) have a label that is no class of the model, which no prediction can match: 42 (4 rows)" in r.stderr


def test_serve_predict_writes_the_format_its_output_names(endpoint, s3, bucket, tmp_path):
    """-o preds.parquet got CSV text under a Parquet name; each format a table is read in is
    written by its suffix, to a file or to S3, and reads back as the CSV's predictions."""
    import io
    import subprocess
    import sys

    import pandas as pd

    from kfp_pytorch.components.batch_predict import table_bytes
    from kfp_pytorch.components.prepare_data import load_table

    cli = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", "digits",  # noqa: E731
                                     str(tmp_path / "rows.csv"), "--probabilities", *a],
                                    capture_output=True, text=True, timeout=300)
    load_table("sample://digits").head(30).to_csv(tmp_path / "rows.csv", index=False)
    plain = cli()
    assert plain.returncode == 0, plain.stderr
    expect = pd.read_csv(io.StringIO(plain.stdout))
    for out in [tmp_path / "p.parquet", tmp_path / "p.jsonl", tmp_path / "p.json", tmp_path / "p.feather",
                f"s3://{bucket}/scored/p.jsonl"]:
        r = cli("-o", str(out))
        assert r.returncode == 0 and r.stdout == "", r.stderr
        got = load_table(str(out), s3)
        pd.testing.assert_frame_equal(got, expect, check_dtype=False)
    assert s3.read_bytes(f"s3://{bucket}/scored/p.jsonl").startswith(b'{"row":1,"prediction":')
    data, kind = table_bytes(expect, "x.parquet")
    assert data[:4] == b"PAR1" and kind == "application/vnd.apache.parquet"


def test_serve_predict_writes_its_predictions_to_s3(endpoint, s3, bucket, tmp_path):
    """-o s3://BUCKET/KEY puts the CSV in the store; a bucket that is not there, or a URI naming
    no object, is refused before a row is sent."""
    import io
    import subprocess
    import sys

    import pandas as pd

    from kfp_pytorch.components.prepare_data import load_table

    cli = lambda *a: subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    load_table("sample://digits").head(40).to_csv(tmp_path / "rows.csv", index=False)
    local = cli("digits", str(tmp_path / "rows.csv"))
    assert local.returncode == 0, local.stderr
    uri = f"s3://{bucket}/scored/predictions.csv"
    r = cli("digits", str(tmp_path / "rows.csv"), "-o", uri)
    assert r.returncode == 0 and r.stdout == "" and "40 rows predicted by digits" in r.stderr, r.stderr
    assert r.stderr.rstrip().endswith(f"; written to {uri}")
    stored = pd.read_csv(io.BytesIO(s3.read_bytes(uri)))
    assert stored.equals(pd.read_csv(io.StringIO(local.stdout))) and len(stored) == 40
    # refused before any work: the server is not even looked up ('nothere' is no server)
    r = cli("nothere", str(tmp_path / "rows.csv"), "-o", "s3://no-such-bucket-here/p.csv")
    assert r.returncode == 1 and "-o/--output: there is no bucket 'no-such-bucket-here'" in r.stderr, r.stderr
    assert "kfp-pytorch storage mb s3://no-such-bucket-here" in r.stderr and "no local model server" not in r.stderr
    r = cli("nothere", str(tmp_path / "rows.csv"), "-o", f"s3://{bucket}/scored/")
    assert r.returncode == 2 and f"-o/--output: 's3://{bucket}/scored/' names no object" in r.stderr, r.stderr
    assert f"s3://{bucket}/predictions.csv" in r.stderr and s3.list(f"s3://{bucket}/") == [uri]


def test_two_deploys_of_one_name_at_once_leave_one_server_and_no_orphan(trained_model):
    """Two runs serving one name at once (two notebooks): both read 'no server yet', both started
    one, and the record kept the second; the first served on, out of serve list's and serve stop's
    reach. Deploys of a name now wait for each other, so the second replaces the first."""
    import subprocess
    import sys

    def predictors():
        return sorted(p.pid for p in psutil.process_iter(["cmdline"])
                      if "kfp_pytorch.components.kserve_predictor" in (p.info["cmdline"] or [])
                      and "twice" in (p.info["cmdline"] or []))

    cmd = [sys.executable, "-m", "kfp_pytorch.cli", "serve", "start", "twice", "--model-uri", trained_model.model_uri]
    try:
        runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [r.communicate(timeout=300) for r in runs]
        assert [r.returncode for r in runs] == [0, 0], outs
        [up] = [x for x in list_servers() if x["name"] == "twice"]
        assert predictors() == [up["pid"]] and up["alive"]
        assert sum("it replaced the server of" in out for out, _ in outs) == 1, outs  # the second took over
    finally:
        stop_server("twice")
        for pid in predictors():  # an orphan of the old race: no record names it
            psutil.Process(pid).kill()


def test_a_registered_version_or_an_older_runs_model_is_served_by_name(mlflow_server, s3, trained_model, tmp_path):
    """A rollback: `serve start NAME --model-uri models:/MODEL/VERSION` serves a version from the
    real MLflow registry (artifacts on S3), and a champion alias or a run's model directory
    replaces it only once the new server answers."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd

    from kfp_pytorch.components.register import RegisterSpec, register

    uri = mlflow_server.url
    metrics = {"accuracy": 0.95, "macro_f1": 0.95}
    first = register(RegisterSpec(trained_model.model_uri, "rollback-digits", metrics, True, tracking_uri=uri))
    second = register(RegisterSpec(trained_model.model_uri, "rollback-digits", {**metrics, "accuracy": 0.97}, True,
                                   tracking_uri=uri))
    v1, v2 = first["version"], second["version"]

    embedded = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the default store

    def start(*a, registry=uri):
        r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "start", *a]
                           + (["--tracking-uri", registry] if registry else []), capture_output=True, text=True,
                           env=os.environ if registry else embedded)
        assert "Traceback" not in r.stderr, r.stderr
        return r

    row = [read_metadata(trained_model.model_uri)["normalization"]["mean"]]
    try:
        r = start("rollback", "--model-uri", f"models:/rollback-digits/{v1}")
        assert r.returncode == 0, r.stderr
        [up] = [s for s in list_servers() if s["name"] == "rollback"]
        assert r.stdout == f"rollback: serving models:/rollback-digits/{v1} at {up['infer_url']} (pid {up['pid']})\n"
        assert f"rollback-digits-v{v1}" in up["model_uri"] and infer(up["url"], "rollback", row)["outputs"]
        assert up["registered_model"] == f"models:/rollback-digits/{v1}"  # which version serves, not only its files
        r = start("rollback", "--model-uri", "models:/rollback-digits@champion")  # moved to the second version
        [now] = [s for s in list_servers() if s["name"] == "rollback"]
        assert r.returncode == 0 and now["alive"] and now["pid"] != up["pid"], r.stderr
        assert r.stdout.startswith(f"rollback: serving models:/rollback-digits/{v2} (@champion) at {now['infer_url']} ")
        assert f"it replaced the server of models:/rollback-digits/{v1} at {up['infer_url']}" in r.stdout
        assert now["registered_model"] == f"models:/rollback-digits/{v2}"  # the alias resolved: the version
        listed = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "list"], capture_output=True,
                                text=True, check=True).stdout
        assert f"   models:/rollback-digits/{v2} ({now['model_uri']})" in listed, listed
        assert not psutil.pid_exists(up["pid"]) or psutil.Process(up["pid"]).status() == psutil.STATUS_ZOMBIE
        # the embedded store's version of the same name and number is another model: not the
        # server registry's download, served from a folder of its own
        own = json.loads(subprocess.run(  # a process of its own: MLflow keeps the last registry as a global
            [sys.executable, "-c", "import json, sys; from kfp_pytorch.components.register import RegisterSpec, register; "
             "print(json.dumps(register(RegisterSpec(sys.argv[1], 'rollback-digits', {'accuracy': 0.9}, True))))",
             trained_model.model_uri], capture_output=True, text=True, check=True, env=embedded).stdout.splitlines()[-1])
        r = start("embedded", "--model-uri", f"models:/rollback-digits/{own['version']}", registry=None)
        [other] = [s for s in list_servers() if s["name"] == "embedded"]
        assert r.returncode == 0 and own["version"] == v1 and other["model_uri"] != up["model_uri"], r.stderr
        assert other["model_uri"].startswith(str(Path(os.environ["KFP_PYTORCH_HOME"]) / "registry_models"))
        # a run's model directory, as `runs --local` shows it
        r = start("from-run", "--model-uri", trained_model.model_uri)
        assert r.returncode == 0 and r.stdout.startswith(f"from-run: serving {trained_model.model_uri} at "), r.stderr
        [run_dir] = [s for s in list_servers() if s["name"] == "from-run"]
        assert run_dir["registered_model"] == ""  # a directory: no registered version is claimed
        # what is not there says what is; nothing is started, and the server up stays up
        r = start("rollback", "--model-uri", f"models:/rollback-digits/{v2 + 5}")
        assert r.returncode == 1 and f"models:/rollback-digits/{v2 + 5}: not in the MLflow registry at {uri}" in r.stderr
        assert f"'rollback-digits' has version(s) {v1}, {v2}; aliases: @champion = version {v2}" in r.stderr
        r = start("rollback", "--model-uri", "models:/no-such-model@champion")
        assert r.returncode == 1 and "there is no registered model 'no-such-model'; registered: " in r.stderr
        r = start("rollback", "--model-uri", "models:rollback-digits")
        assert r.returncode == 2 and "write models:/MODEL/VERSION or models:/MODEL@ALIAS" in r.stderr
        r = start("rollback", "--model-uri", str(tmp_path))
        assert r.returncode == 2 and f"no trained model at {tmp_path} (metadata.json missing)" in r.stderr
        assert "hint: give --model-uri a run's train-op.model directory (`kfp-pytorch runs --local` lists the runs)" in r.stderr
        r = start("Rollback", "--model-uri", f"models:/rollback-digits/{v1}")
        assert r.returncode == 2 and "model_name: must be a DNS-1123 label" in r.stderr
        assert start("a", "b", "--model-uri", trained_model.model_uri).returncode == 2
        assert [s["pid"] for s in list_servers() if s["name"] == "rollback"] == [now["pid"]] and psutil.pid_exists(now["pid"])
        # serve predict takes a registered version for the features too (MLFLOW_TRACKING_URI's registry);
        # before, 'unsupported URI scheme models'
        pd.DataFrame(row, columns=read_metadata(trained_model.model_uri)["features"]).to_csv(tmp_path / "row.csv",
                                                                                          index=False)
        download = next(p for p in Path(now["model_uri"]).parents if p.parent.name == "registry_models")
        os.utime(download, (1e9, 1e9))  # each use of a download marks it, so `runs --local --keep` spares it
        r = subprocess.run([sys.executable, "-m", "kfp_pytorch.cli", "serve", "predict", "rollback",
                            str(tmp_path / "row.csv"), "--model-uri", "models:/rollback-digits@champion"],
                           capture_output=True, text=True, env={**os.environ, "MLFLOW_TRACKING_URI": uri})
        assert r.returncode == 0 and r.stdout.startswith("row,prediction,confidence\n1,"), r.stderr
        assert "1 rows predicted by rollback" in r.stderr and download.stat().st_mtime > 1e9
        psutil.Process(now["pid"]).kill()  # a crash: started again, it still says which version it serves
        psutil.Process(now["pid"]).wait(10)
        assert start("rollback", registry=None).returncode == 0
        [again] = [s for s in list_servers() if s["name"] == "rollback"]
        assert again["alive"] and again["registered_model"] == f"models:/rollback-digits/{v2}"
    finally:
        stop_server("rollback")
        stop_server("embedded")
        stop_server("from-run")


def test_a_server_replaced_while_a_table_is_predicted_writes_nothing_from_two_models(endpoint, trained_model,
                                                                                     tmp_path):
    # A run that redeploys the name while a table is predicted: the rows before came from the old
    # model. A redeploy keeps the URL, so the batches after it are answered, by the new model:
    # the responses' model_version (the model's fingerprint) says so, and nothing is written.
    import dataclasses

    from kfp_pytorch.components.batch_predict import predict_rows, resolve_target

    target = resolve_target("digits")
    x = np.zeros((6, 64), dtype=np.float32)
    retrained = _another_model(trained_model.model_uri, tmp_path / "retrained")
    seen = []

    def redeploy_after_the_first_batch(k):
        seen.append(k)
        if len(seen) == 1:
            serve(ServeSpec(retrained, "digits"))  # a new server on the same URL; the old one stops

    with pytest.raises(ServingError) as e:
        predict_rows(target, x, batch_size=2, on_batch=redeploy_after_the_first_batch)
    [now] = [s for s in list_servers() if s["name"] == "digits"]
    assert now["pid"] != endpoint.pid and now["url"] == endpoint.url and seen == [2]
    assert e.value.message == (f"rows 3-4: the local model server 'digits' was replaced while the table was predicted "
                               f"(now pid {now['pid']} at {now['url']}, model {retrained}); the rows "
                               "before came from the model it served before, so nothing is written")
    assert e.value.hint == "run serve predict again: every row from one model"
    assert predict_rows(resolve_target("digits"), x, batch_size=2)["label"]  # the new server answers

    # by URL (a KServe endpoint, no local record): a redeploy or a canary is told by the same sign
    seen.clear()
    by_url = dataclasses.replace(resolve_target("digits"), pid=None)
    with pytest.raises(ServingError) as e:
        predict_rows(by_url, x, batch_size=2,
                     on_batch=lambda k: seen.append(k) or (len(seen) == 1 and serve(ServeSpec(trained_model.model_uri,
                                                                                              "digits"))))
    first, then = ModelRunner(retrained).fingerprint, ModelRunner(trained_model.model_uri).fingerprint
    assert e.value.message == (f"rows 3-4: the server at {endpoint.url} answered with another model (model_version "
                               f"{then}) than the rows before ({first}): it was redeployed, or a canary splits its "
                               "traffic between two models, while the table was predicted; nothing is written")
    assert "once it is promoted, or rolled back" in e.value.hint
    # the same model served again (a restart, a redeploy of the same files) is no change of model
    assert len(predict_rows(by_url, x, batch_size=2, on_batch=lambda k: serve(ServeSpec(trained_model.model_uri,
                                                                                       "digits")))["label"]) == 6
