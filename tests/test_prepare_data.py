import json
import math

import numpy as np
import pandas as pd
import pytest

from kfp_pytorch.components.errors import ConfigError, DatasetError
from kfp_pytorch.components.prepare_data import PrepareSpec, load_split, load_table, prepare_data, read_metadata


def test_digits_split_is_deterministic_stratified_and_normalised(tmp_path):
    a = prepare_data(PrepareSpec("sample://digits", str(tmp_path / "a"), seed=7))
    b = prepare_data(PrepareSpec("sample://digits", str(tmp_path / "b"), seed=7))
    c = prepare_data(PrepareSpec("sample://digits", str(tmp_path / "c"), seed=8))
    sums = lambda m: [s["sha256"] for split in ("train", "val", "test") for s in m["shards"][split]]  # noqa: E731
    assert sums(a) == sums(b) and sums(a) != sums(c)
    assert sum(a["rows"].values()) == 1797 and a["num_classes"] == 10 and a["image_shape"] == [1, 8, 8]
    x_tr, y_tr = load_split(str(tmp_path / "a"), "train")
    x_te, y_te = load_split(str(tmp_path / "a"), "test")
    assert x_tr.dtype == np.float32 and y_tr.dtype == np.int64
    assert abs(float(x_tr.mean())) < 1e-4  # normalised with train statistics
    p_tr = np.bincount(y_tr, minlength=10) / len(y_tr)
    p_te = np.bincount(y_te, minlength=10) / len(y_te)
    assert np.abs(p_tr - p_te).max() < 0.02  # stratified
    assert read_metadata(str(tmp_path / "a"))["split"]["seed"] == 7


def test_shards_are_about_16_mib_by_default_and_read_back_in_order(tmp_path, monkeypatch):
    # 512-row shards made a 500k-row table 684 objects a rank read one request each (8x slower than
    # 16384-row ones from SeaweedFS): the default is now shards of about SHARD_BYTES
    import kfp_pytorch.components.prepare_data as pd_mod

    meta = prepare_data(PrepareSpec("sample://digits", str(tmp_path / "a")))
    assert pd_mod.SHARD_BYTES == 16 << 20
    assert {split: len(meta["shards"][split]) for split in meta["shards"]} == {"train": 1, "val": 1, "test": 1}
    x_one, y_one = load_split(str(tmp_path / "a"), "train")
    # a small target (the size a wide table's rows come to): rows of 64 float32 features and an int64
    # label are 264 bytes, so 15 to a shard of 4096 bytes, read back in their order
    monkeypatch.setattr(pd_mod, "SHARD_BYTES", 4096)
    meta = prepare_data(PrepareSpec("sample://digits", str(tmp_path / "b")))
    rows = [s["rows"] for s in meta["shards"]["train"]]
    assert len(rows) == math.ceil(meta["rows"]["train"] / 15) and set(rows[:-1]) == {15} and sum(rows) == 1257
    x_many, y_many = load_split(str(tmp_path / "b"), "train")
    assert np.array_equal(x_many, x_one) and np.array_equal(y_many, y_one)
    assert len(prepare_data(PrepareSpec("sample://digits", str(tmp_path / "c"), shard_rows=100))["shards"]["train"]) == 13


def test_features_of_any_magnitude_are_normalised_and_constant_ones_centred(tmp_path):
    d = _table()
    d["a"] = d["a"] * 1e20  # finite in float32, but its squares are not: the std came out inf, the column 0
    d["b"] = d["b"] * 1e-8  # small units: under the old fixed 1e-6 cut-off it was taken for constant
    d["c"] = 3.25
    d.to_csv(tmp_path / "t.csv", index=False)
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o")))
    assert np.isfinite(meta["normalization"]["std"]).all() and meta["normalization"]["std"][2] == 1.0
    x, _ = load_split(str(tmp_path / "o"), "train")
    assert np.allclose(x[:, [0, 1, 3]].std(axis=0), 1, atol=1e-3) and (x[:, 2] == 0).all()


def test_corrupt_shard_is_detected(tmp_path):
    meta = prepare_data(PrepareSpec("sample://digits", str(tmp_path / "d")))
    shard = tmp_path / "d" / meta["shards"]["test"][0]["path"]
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(DatasetError, match="checksum"):
        load_split(str(tmp_path / "d"), "test")


def _table(n=60, classes=3):
    rng = np.random.default_rng(0)
    df = pd.DataFrame(rng.normal(size=(n, 4)), columns=["a", "b", "c", "d"])
    df["label"] = np.arange(n) % classes
    return df


def test_csv_from_s3_to_s3(s3, bucket):
    s3.write_bytes(f"s3://{bucket}/raw/table.csv", _table().to_csv(index=False).encode())
    meta = prepare_data(PrepareSpec(f"minio://{bucket}/raw/table.csv", f"s3://{bucket}/prepared", shard_rows=16))
    assert meta["features"] == ["a", "b", "c", "d"] and meta["classes"] == [0, 1, 2]
    listed = s3.list(f"s3://{bucket}/prepared")
    assert f"s3://{bucket}/prepared/metadata.json" in listed and len(listed) > 4
    x, y = load_split(f"s3://{bucket}/prepared", "train", s3)
    assert len(x) == meta["rows"]["train"]
    assert json.loads(s3.read_bytes(f"s3://{bucket}/prepared/metadata.json"))["rows"] == meta["rows"]


@pytest.mark.parametrize("mutate,expect", [
    (lambda d: d.drop(columns=["label"]), "label column 'label' is missing"),
    (lambda d: d.assign(a=d["a"].mask(d.index < 3)), "column 'a': 3 empty or NaN value(s), rows 1, 2, 3"),
    (lambda d: d.assign(b=["x"] * len(d)), "column 'b': must be numeric, got text (row 1: 'x')"),
    # a column of numbers but for a stray cell: the cell, by row, not "got dtype object"
    (lambda d: d.assign(b=d["b"].astype(object).where(d.index != 6, "?")), "column 'b': 1 value(s) are not numbers: "
                                                                          "row 7 '?'"),
    (lambda d: d.assign(label=d["label"] + 0.5), "must hold integer class ids"),
    (lambda d: d.assign(label=0), "needs at least 2 classes"),
    # an inf made the train mean inf and every normalised row NaN: training then "diverged"
    (lambda d: d.assign(a=d["a"].where(d.index != 4, float("inf"))), "column 'a': 1 infinite value(s), row 5"),
    (lambda d: d.assign(a=d["a"].where(d.index > 1, -1e39)), "column 'a': 2 value(s) beyond float32's range (±3.4e+38), rows 1, 2"),
])
def test_bad_tables_are_rejected_with_the_column(tmp_path, mutate, expect):
    path = tmp_path / "t.csv"
    mutate(_table()).to_csv(path, index=False)
    out = tmp_path / "out"
    with pytest.raises(DatasetError) as e:
        prepare_data(PrepareSpec(str(path), str(out)))
    assert expect in str(e.value) and e.value.hint
    assert not out.exists()  # nothing half-written


def test_all_problems_reported_together(tmp_path):
    d = _table()
    d["a"] = d["a"].mask(d.index < 2)
    d["b"] = "x"
    d.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DatasetError) as e:
        prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o")))
    assert "'a'" in str(e.value) and "'b'" in str(e.value)


def test_missing_dataset_and_bad_settings(tmp_path):
    with pytest.raises(DatasetError, match="dataset not found"):
        prepare_data(PrepareSpec(str(tmp_path / "nope.csv"), str(tmp_path / "o")))
    with pytest.raises(ConfigError, match="dataset_uri: unknown sample dataset 'mnist'; the samples: sample://digits"):
        prepare_data(PrepareSpec("sample://mnist", str(tmp_path / "o")))  # before anything is read or written
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError) as e:
        prepare_data(PrepareSpec("sample://digits", str(tmp_path / "o"), val_fraction=0.7, shard_rows=-1, seed=-1))
    assert "val_fraction" in str(e.value) and "shard_rows: must be >= 1, or 0 for shards of about 16 MiB, got -1" in str(e.value)
    assert "seed: must be an integer from 0 to 4294967295, got -1" in str(e.value)  # was sklearn's InvalidParameterError
    assert not (tmp_path / "o").exists()


def test_an_output_that_cannot_be_written_is_refused_before_the_table_is_read(s3, tmp_path):
    # a file where the shards' folder would be failed only at the first shard's write, after the
    # whole table was read and split; a misspelt bucket was made by SeaweedFS on that write
    from kfp_pytorch.components.errors import StorageError, StorageNotFound

    table = tmp_path / "rows.csv"
    table.write_text("a,label\n1,0\n")
    with pytest.raises(StorageError) as e:
        prepare_data(PrepareSpec("sample://digits", str(table / "out")))
    assert e.value.message == f"write {table / 'out'}: {table} is a file, where that path needs a folder"
    with pytest.raises(StorageNotFound) as e:
        prepare_data(PrepareSpec("sample://digits", "s3://no-such-bucket-prep/out"))
    assert e.value.message == "write s3://no-such-bucket-prep/out: there is no bucket 'no-such-bucket-prep'"
    assert "kfp-pytorch storage mb s3://no-such-bucket-prep" in e.value.hint
    assert not s3.bucket_exists("s3://no-such-bucket-prep") and table.read_text() == "a,label\n1,0\n"


def test_a_table_too_small_to_split_says_how_many_rows_it_needs(tmp_path):
    from kfp_pytorch.components.prepare_data import _split, _split_sizes

    path = tmp_path / "t.csv"
    pd.DataFrame({"a": np.arange(6.0), "label": [0, 1] * 3}).to_csv(path, index=False)
    with pytest.raises(DatasetError) as e:  # was sklearn's "test_size = 1 should be greater or equal to ..."
        prepare_data(PrepareSpec(str(path), str(tmp_path / "o")))
    assert ("the table has 6 rows for 2 classes: the split would give val 1, test 1 row(s), and a stratified split "
            "needs every class in every split; give at least 8 rows") in str(e.value)
    # the figure is the split's own: at 8 rows every split holds both classes
    y = np.array([0, 1] * 4)
    parts = _split(y, PrepareSpec("x", "y"))
    assert {k: len(v) for k, v in parts.items()} == _split_sizes(8, 0.15, 0.15) == {"train": 4, "val": 2, "test": 2}
    assert all(set(y[v]) == {0, 1} for v in parts.values())
    pd.DataFrame({"a": np.arange(8.0), "label": [0, 1] * 4}).to_csv(path, index=False)
    assert prepare_data(PrepareSpec(str(path), str(tmp_path / "o")))["rows"] == {"train": 4, "val": 2, "test": 2}


def test_class_names_are_numbered_in_sorted_order_and_checked_like_ids(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "t.csv"
    pd.DataFrame({"a": rng.normal(size=40), "label": [True, False] * 20}).to_csv(path, index=False)
    meta = prepare_data(PrepareSpec(str(path), str(tmp_path / "b")))
    assert meta["class_names"] == ["False", "True"] and meta["num_classes"] == 2
    _, y = load_split(str(tmp_path / "b"), "train")
    assert set(y.tolist()) == {0, 1}
    pd.DataFrame({"a": rng.normal(size=32), "label": ["cat", "dog"] * 15 + ["rare", "rare"]}).to_csv(path, index=False)
    with pytest.raises(DatasetError, match=r"classes \['rare'\] have fewer than 3 rows"):
        prepare_data(PrepareSpec(str(path), str(tmp_path / "c")))
    ages = np.r_[np.arange(18, 90), [30, 30, 30, 40, 40, 40]]  # an age to predict, as integers: 72 values
    pd.DataFrame({"a": rng.normal(size=len(ages)), "label": ages}).to_csv(path, index=False)
    with pytest.raises(DatasetError) as e:
        prepare_data(PrepareSpec(str(path), str(tmp_path / "ages")))
    assert ("classes [18, 19, 20, 21, 22, 23, 24, 25, 26, 27, ...] (70 of 72) have fewer than 3 rows; a stratified "
            "train/val/test split needs at least 3 per class; with so many values the label may be a quantity "
            "(regression)") in str(e.value)
    pd.DataFrame({"a": rng.normal(size=30), "label": [0.5, 1.0, 2.0] * 10}).to_csv(path, index=False)
    with pytest.raises(DatasetError, match="must hold integer class ids or class names, got fractional numbers") as e:
        prepare_data(PrepareSpec(str(path), str(tmp_path / "d")))
    assert ("(10 of 30: row 1 0.5, row 4 0.5, row 7 0.5 ...); this pipeline trains classifiers: a quantity to predict "
            "(regression) is not one of them, though binned into ranges (low, medium, high) it is") in str(e.value)
    pd.DataFrame({"a": rng.normal(size=30), "label": [7, 40000, 123456] * 10}).to_csv(path, index=False)
    with pytest.raises(DatasetError, match=r"class ids run up to 123456 for 3 classes, so the model would have "
                                           r"123457 outputs; number the classes 0..2, or write them as text"):
        prepare_data(PrepareSpec(str(path), str(tmp_path / "f")))
    pd.DataFrame({"a": rng.normal(size=30), "label": [-1, 1] * 15}).to_csv(path, index=False)  # SVM-style labels
    with pytest.raises(DatasetError, match=r"class ids must be >= 0 \(the model has an output per id from 0\), got -1; "
                                           r"number the classes 0..1, or write them as text to be named"):
        prepare_data(PrepareSpec(str(path), str(tmp_path / "g")))
    assert read_metadata(str(tmp_path / "b"))["class_names"] == ["False", "True"]
    assert prepare_data(PrepareSpec("sample://digits", str(tmp_path / "e")))["class_names"] is None  # ids stay ids


def test_a_named_label_and_chosen_features_leave_other_columns_out_of_the_model(tmp_path):
    # an export as a data scientist has it: an id, a free-text note with gaps, a label called 'species'
    d = _table().rename(columns={"label": "species"})
    d["species"] = d["species"].map({0: "setosa", 1: "versicolor", 2: "virginica"})
    d.insert(0, "customer_id", [f"c{i}" for i in range(len(d))])
    d["note"] = ["ok", None] * (len(d) // 2)
    path = tmp_path / "t.csv"
    d.to_csv(path, index=False)
    meta = prepare_data(PrepareSpec(str(path), str(tmp_path / "o"), label_column="species", feature_columns=("d", "a")))
    assert meta["features"] == ["d", "a"] and meta["num_features"] == 2 and meta["label_column"] == "species"
    assert meta["class_names"] == ["setosa", "versicolor", "virginica"]
    x, _ = load_split(str(tmp_path / "o"), "train")
    assert x.shape[1] == 2  # in the order given: d's normalisation first
    assert meta["normalization"]["mean"][0] == pytest.approx(float(d.loc[:, "d"].iloc[_train_rows(tmp_path)].mean()), abs=1e-5)
    # without a choice, the id and the note are refused with the way out (the note's gaps go with it)
    with pytest.raises(DatasetError) as e:
        prepare_data(PrepareSpec(str(path), str(tmp_path / "p"), label_column="species"))
    assert ("column 'customer_id': must be numeric, got text (row 1: 'c0') (leave it out: list the features in "
            "feature_columns)") in str(e.value) and "column 'note': must be numeric, got text (row 1: 'ok')" in str(e.value)
    assert "NaN value" not in str(e.value)
    assert not (tmp_path / "p").exists()


def test_repeated_rows_are_counted_and_a_test_row_also_trained_on_is_told(tmp_path):
    from kfp_pytorch.components.prepare_data import duplicates_note

    t = _table()
    again = t.iloc[:20]  # repeated as they are, and three more with another label
    relabelled = t.iloc[20:23].assign(label=lambda d: (d["label"] + 1) % 3)
    pd.concat([t, again, relabelled]).to_csv(tmp_path / "t.csv", index=False)
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o")))
    train, _ = load_split(str(tmp_path / "o"), "train")
    test, _ = load_split(str(tmp_path / "o"), "test")
    seen = {tuple(r) for r in train.tolist()}
    in_train = sum(tuple(r) in seen for r in test.tolist())  # the same raw row is the same normalised row
    assert in_train > 0 and meta["duplicates"] == {"rows": 23, "test_rows_in_train": in_train, "conflicting": 6}
    assert duplicates_note(meta["duplicates"], meta["rows"]) == (
        f"{in_train} of the {meta['rows']['test']} test rows are also training rows, so the test metrics are "
        "optimistic; 6 rows share their features with a row of another label (23 repeated rows in the table; "
        "drop them, e.g. pandas' drop_duplicates(), for an honest test)")
    t.to_csv(tmp_path / "u.csv", index=False)
    clean = prepare_data(PrepareSpec(str(tmp_path / "u.csv"), str(tmp_path / "p")))
    assert clean["duplicates"] == {"rows": 0, "test_rows_in_train": 0, "conflicting": 0}
    assert duplicates_note(clean["duplicates"], clean["rows"]) is None


def _train_rows(tmp_path):
    """The table rows of the train split prepare_data wrote to tmp_path/o (same seed, same split)."""
    from kfp_pytorch.components.prepare_data import _split

    meta = read_metadata(str(tmp_path / "o"))
    y = np.arange(60) % 3
    return _split(y, PrepareSpec("x", "y", seed=meta["split"]["seed"]))["train"]


@pytest.mark.parametrize("label,features,expect", [
    ("species", (), "label column 'species' is missing (columns: a, b, c, d, Species); did you mean 'Species'? "
                    "(set label_column)"),
    ("label", (), "label column 'label' is missing (columns: a, b, c, d, Species); label_column must name one of them"),
    ("Species", ("a", "bb", "zz"), "feature column 'bb' is missing (columns: a, b, c, d, Species); did you mean 'b'? "
                                   "(set feature_columns)"),
    ("Species", ("a", "bb", "zz"), "feature column 'zz' is missing (columns: a, b, c, d, Species); feature_columns "
                                   "must name one of them"),
])
def test_a_column_the_table_lacks_is_named_with_the_nearest_it_has(tmp_path, label, features, expect):
    path = tmp_path / "t.csv"
    _table().rename(columns={"label": "Species"}).to_csv(path, index=False)
    with pytest.raises(DatasetError) as e:
        prepare_data(PrepareSpec(str(path), str(tmp_path / "o"), label_column=label, feature_columns=features))
    assert expect in str(e.value) and e.value.hint
    assert not (tmp_path / "o").exists()


def test_column_settings_are_checked_before_the_table_is_read(tmp_path):
    from kfp_pytorch.components.prepare_data import parse_columns

    assert parse_columns(" a, b ,c") == ("a", "b", "c") and parse_columns("  ") == ()
    with pytest.raises(ConfigError) as e:
        prepare_data(PrepareSpec(str(tmp_path / "absent.csv"), str(tmp_path / "o"), label_column="y",
                                 feature_columns=parse_columns("a,,a,y")))
    assert e.value.problems == [
        "feature_columns: an empty column name in 'a, , a, y' (write names separated by commas: a,b,c)",
        "feature_columns: 'a' given more than once",
        "feature_columns: must not hold the label column 'y' (the model would be given the answer)"]


def test_a_subset_of_an_images_pixels_is_no_longer_an_image(tmp_path):
    meta = prepare_data(PrepareSpec("sample://digits", str(tmp_path / "o"),
                                    feature_columns=tuple(f"pixel_{r}_{c}" for r in range(2, 6) for c in range(8))))
    assert meta["num_features"] == 32 and meta["image_shape"] is None


@pytest.mark.parametrize("names,shape", [
    ([f"pixel{i}" for i in range(784)], [1, 28, 28]),                      # Kaggle's MNIST CSV
    ([f"pixel{i}" for i in range(1, 785)], [1, 28, 28]),                   # Fashion-MNIST's, from 1
    ([str(i) for i in range(64)], [1, 8, 8]),                              # a numpy array's to_csv
    ([f"{r}x{c}" for r in range(1, 29) for c in range(1, 29)], [1, 28, 28]),
    ([f"px_{r}_{c}" for r in range(3) for c in range(5)], [1, 3, 5]),       # a grid need not be square
    (["f 1", "f,2", 'f"3', "é4"], None),                                   # features, 4 of them: no 2x2 image
    ([f"f{i}" for i in range(10)], None),                                  # numbered, but not a square
    ([f"pixel{i}" for i in range(2, 66)], None),                           # a pixel missing from the start
    ([f"pixel{i}" for i in (0, 1, 3, 2)], None),                           # out of order
    ([f"pixel_{r}_{c}" for c in range(8) for r in range(8)], None),        # column-major
    ([f"a{i}" for i in range(8)] + [f"b{i}" for i in range(8)], None),     # two prefixes
])
def test_an_images_pixels_are_known_by_their_names(tmp_path, names, shape):
    from kfp_pytorch.components.prepare_data import pixel_grid

    assert pixel_grid(names) == shape
    rng = np.random.default_rng(0)
    table = pd.DataFrame(rng.integers(0, 255, (40, len(names))), columns=names).assign(label=np.arange(40) % 2)
    table.to_csv(tmp_path / "t.csv", index=False)
    assert prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o")))["image_shape"] == shape


def test_a_parquet_table_is_read_and_its_features_chosen_by_name(tmp_path):
    d = _table().rename(columns={"label": "kind"})
    d.to_parquet(tmp_path / "t.parquet")
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.parquet"), str(tmp_path / "o"), label_column="kind",
                                    feature_columns=("d", "a")))
    assert meta["features"] == ["d", "a"] and meta["num_features"] == 2 and meta["classes"] == [0, 1, 2]
    x, _ = load_split(str(tmp_path / "o"), "train")
    assert x.shape[1] == 2
    # a frame of numbered columns keeps its numbers in Parquet; parameters name them by text
    numbered = _table()
    numbered.columns = range(5)
    numbered.to_parquet(tmp_path / "n.parquet")
    meta = prepare_data(PrepareSpec(str(tmp_path / "n.parquet"), str(tmp_path / "p"), label_column="4",
                                    feature_columns=("3", "0")))
    assert meta["features"] == ["3", "0"] and meta["label_column"] == "4" and meta["classes"] == [0, 1, 2]


@pytest.mark.parametrize("write, expect", [
    (dict(sep=";", decimal=","), "semicolon-separated, decimal commas"),  # a European spreadsheet's export
    (dict(sep=";"), "semicolon-separated"),
    (dict(sep="\t"), "tab-separated"),
    (dict(sep="|"), "pipe-separated"),
    (dict(), None),
])
def test_a_table_separated_by_semicolons_tabs_or_pipes_is_read_as_its_comma_twin(tmp_path, write, expect):
    d = _table()
    d["note"] = ["x, y; z"] * len(d)  # a text cell holding every separator, quoted by the writer
    d.to_csv(tmp_path / "t.csv", index=False, **write)
    twin = _table().assign(note="x, y; z")
    twin.to_csv(tmp_path / "twin.csv", index=False)
    table, plain = load_table(str(tmp_path / "t.csv")), load_table(str(tmp_path / "twin.csv"))
    pd.testing.assert_frame_equal(table, plain)
    assert table.attrs.get("csv_format") == expect
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o"), feature_columns=("a", "b", "c", "d")))
    assert meta["features"] == ["a", "b", "c", "d"] and meta["classes"] == [0, 1, 2]
    assert meta["source_format"] == expect  # said in the step's log and the run's summary


@pytest.mark.parametrize("sep, decimal, expect", [
    (";", ",", "semicolon-separated, decimal commas"),  # German Excel: "Länge, cm" is not quoted there
    (";", ".", "semicolon-separated"),
    ("\t", ".", "tab-separated"),
])
def test_header_names_holding_a_comma_do_not_make_the_table_comma_separated(tmp_path, sep, decimal, expect):
    # the header splits into as many columns at its commas as at its real separator: the rows decide
    d = _table()
    d.columns = ["length, cm", "width, cm", "depth, cm", "mass, kg", "label"]
    d.to_csv(tmp_path / "t.csv", index=False, sep=sep, decimal=decimal)
    assert "length, cm" in (tmp_path / "t.csv").read_text().splitlines()[0]  # unquoted, as spreadsheets write it
    table = load_table(str(tmp_path / "t.csv"))
    pd.testing.assert_frame_equal(table, d)
    assert table.attrs.get("csv_format") == expect


@pytest.mark.parametrize("sep, decimal", [(",", "."), (";", ",")])
def test_spaces_after_the_separators_are_not_part_of_names_or_values(tmp_path, sep, decimal):
    # "a, b, label" as people type it: before, the label column was ' label' and the classes ' cat'
    d = _table().assign(label=lambda t: t["label"].map({0: "cat", 1: "dog", 2: "eel"}))
    text = d.to_csv(index=False, sep=sep, decimal=decimal).replace(sep, sep + " ")
    assert text.startswith(f"a{sep} b{sep} c")
    (tmp_path / "t.csv").write_text(text)
    pd.testing.assert_frame_equal(load_table(str(tmp_path / "t.csv")), d)
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o")))
    assert meta["features"] == ["a", "b", "c", "d"] and meta["class_names"] == ["cat", "dog", "eel"]


@pytest.mark.parametrize("leftover", ["a separator ending every line", "a separator ending every row",
                                      "two ending every line", "empty rows at the end", "and pandas' row index"])
def test_what_a_spreadsheet_leaves_around_a_table_is_not_part_of_it(tmp_path, leftover):
    # before: an unnamed empty column failed validation, and rows one field wider than the header
    # shifted every column one name to the right (the label column read empty, 'b' the labels)
    d = _table()
    lines = d.to_csv(index=False).splitlines()
    lines = {"a separator ending every line": [f"{x}," for x in lines],
             "a separator ending every row": lines[:1] + [f"{x}," for x in lines[1:]],
             "two ending every line": [f"{x},," for x in lines],
             "empty rows at the end": lines + [",,,,"] * 3,
             "and pandas' row index": [f"{x}," for x in d.to_csv().splitlines()]}[leftover]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    pd.testing.assert_frame_equal(load_table(str(tmp_path / "t.csv")), d)


def test_rows_wider_than_the_header_with_values_there_are_refused_and_an_empty_row_inside_is_named(tmp_path):
    lines = _table().to_csv(index=False).splitlines()
    (tmp_path / "t.csv").write_text("\n".join(lines[:1] + [f"{x},7" for x in lines[1:]]) + "\n")
    with pytest.raises(DatasetError) as e:
        load_table(str(tmp_path / "t.csv"))
    assert "its rows have 6 fields, but its header names 5 columns (row 1 ends in [7]); name every column" in str(e.value)
    (tmp_path / "t.csv").write_text("\n".join(lines[:5] + [",,,,"] + lines[5:]) + "\n")  # not at the end: data missing
    with pytest.raises(DatasetError, match="column 'a': 1 empty or NaN value.s., row 5"):
        prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o")))


@pytest.mark.parametrize("order", ["sorted by label", "shuffled", "text ids"])
def test_the_row_index_pandas_writes_is_not_a_feature(tmp_path, order):
    # df.to_csv(path) writes the index as an unnamed first column; read as a feature, the row's place
    # leaks the label of a table sorted by it (random features scored 0.82 on 3 classes)
    d = _table(n=90).sort_values("label", kind="stable").reset_index(drop=True)
    if order == "shuffled":
        d = d.sample(frac=1, random_state=1)
    elif order == "text ids":
        d.index = [f"id-{i}" for i in range(len(d))]
    d.to_csv(tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_text().startswith(",a,b,c,d,label")
    table = load_table(str(tmp_path / "t.csv"))
    pd.testing.assert_frame_equal(table, d.reset_index(drop=True))
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o")))
    assert meta["features"] == ["a", "b", "c", "d"]
    assert "row-indexed" in meta["source_format"] and "pandas' to_csv" in meta["source_format"]  # said, not silent


def test_an_unnamed_column_that_is_no_row_index_stays_a_column(tmp_path):
    d = _table()
    d.insert(0, "", d.pop("a"))  # a feature whose header cell was left empty: its values repeat nowhere, but floats
    d.to_csv(tmp_path / "t.csv", index=False)
    assert list(load_table(str(tmp_path / "t.csv")).columns) == ["Unnamed: 0", "b", "c", "d", "label"]
    d = _table()
    d.insert(0, "", np.arange(len(d)) % 2)  # integers, but repeated: not an index
    d.to_csv(tmp_path / "t.csv", index=False)
    assert list(load_table(str(tmp_path / "t.csv")).columns) == ["Unnamed: 0", "a", "b", "c", "d", "label"]


def test_a_name_the_header_repeats_is_refused_where_the_column_is_read(tmp_path):
    # pandas renames a repeated 'label' to 'label.1', which then trained as a feature: the answer itself
    d = _table()
    d["label2"] = d["label"]
    d.to_csv(tmp_path / "t.csv", index=False, header=["a", "b", "c", "a", "label", "label"])
    with pytest.raises(DatasetError) as e:
        prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o")))
    assert "column 'a': 2 columns of the header have this name (read as 'a', 'a.1')" in str(e.value)
    assert "column 'label': 2 columns of the header have this name (read as 'label', 'label.1')" in str(e.value)
    assert "or list the features in feature_columns" in str(e.value) and not (tmp_path / "o").exists()
    # a twin that is not read does no harm
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o"), feature_columns=("a", "b", "c")))
    assert meta["features"] == ["a", "b", "c"]


def test_a_name_two_columns_of_a_feather_file_share_is_refused_where_the_column_is_read(tmp_path):
    """A Feather (Arrow) file keeps two columns of one name, which stopped the checks on a bare
    TypeError (pandas' CSV reader renames the second: 'a.1')."""
    import pyarrow as pa
    import pyarrow.feather as feather

    d = _table()
    names = ["a", "b", "c", "a", "label"]
    feather.write_feather(pa.table([d[c].to_numpy() for c in ["a", "b", "c", "a", "label"]], names=names),
                          tmp_path / "t.feather")
    assert list(load_table(str(tmp_path / "t.feather")).columns) == names
    with pytest.raises(DatasetError, match="column 'a': 2 columns of the table have this name; give each column a "
                                           "name of its own, or list the features in feature_columns"):
        prepare_data(PrepareSpec(str(tmp_path / "t.feather"), str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.feather"), str(tmp_path / "o"), feature_columns=("b", "c")))
    assert meta["features"] == ["b", "c"]  # a name shared by columns that are not read does no harm


def test_a_feather_files_category_column_of_numbers_is_a_feature_checked_as_numbers_are(tmp_path):
    # Feather keeps a category column's type (Parquet gives its numbers back): its values are the
    # feature, as serve predict reads them; a value past float32's range was trained on as inf
    rooms = pd.Categorical(np.arange(60) % 4 + 1.0)
    _table().assign(rooms=rooms).to_feather(tmp_path / "t.feather")
    assert isinstance(load_table(str(tmp_path / "t.feather"))["rooms"].dtype, pd.CategoricalDtype)
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.feather"), str(tmp_path / "o")))
    assert meta["features"] == ["a", "b", "c", "d", "rooms"]
    x = np.concatenate([load_split(str(tmp_path / "o"), split)[0] for split in ("train", "val", "test")])
    assert len(np.unique(x[:, 4])) == 4  # the four room counts, normalised
    big = pd.Categorical(np.where(np.arange(60) == 6, 1e39, np.arange(60) % 4 + 1.0))
    _table().assign(rooms=big).to_feather(tmp_path / "big.feather")
    with pytest.raises(DatasetError, match=r"column 'rooms': 1 value\(s\) beyond float32's range \(±3.4e\+38\), row 7"):
        prepare_data(PrepareSpec(str(tmp_path / "big.feather"), str(tmp_path / "o2")))


@pytest.mark.parametrize("name, write", [
    ("t.jsonl", lambda d, p: d.to_json(p, orient="records", lines=True)),
    ("t.ndjson.gz", lambda d, p: d.to_json(p, orient="records", lines=True)),  # compressed: the inner suffix decides
    ("t.json", lambda d, p: d.to_json(p, orient="records")),
    ("lines.json", lambda d, p: d.to_json(p, orient="records", lines=True)),  # JSON Lines under .json
    ("t.feather", lambda d, p: d.to_feather(p)),
])
def test_json_lines_json_and_feather_tables_are_read_as_their_csv_twin(tmp_path, name, write):
    # before, every suffix but Parquet's was read as a CSV: a .jsonl's "columns" were its first record
    d = _table().assign(label=lambda t: t["label"].map({0: "cat", 1: "dog", 2: "eel"}))
    d["created_at"] = 1.7e9 + np.arange(len(d)) + 0.25  # epoch seconds, a number (pandas' JSON reader made it a date)
    write(d, tmp_path / name)
    pd.testing.assert_frame_equal(load_table(str(tmp_path / name)), d)
    meta = prepare_data(PrepareSpec(str(tmp_path / name), str(tmp_path / "o")))
    assert meta["features"] == ["a", "b", "c", "d", "created_at"] and meta["class_names"] == ["cat", "dog", "eel"]


def test_a_json_lines_table_on_s3_keeps_its_format_and_compression(s3, bucket, tmp_path):
    d = _table()
    d.to_json(tmp_path / "t.jsonl.gz", orient="records", lines=True)
    s3.write_bytes(f"s3://{bucket}/raw/t.jsonl.gz", (tmp_path / "t.jsonl.gz").read_bytes())
    pd.testing.assert_frame_equal(load_table(f"s3://{bucket}/raw/t.jsonl.gz", s3), d)


def test_a_damaged_json_lines_table_says_how_to_write_one(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"a": 1, "label": 0}\n{"a": \n')
    with pytest.raises(DatasetError) as e:
        load_table(str(tmp_path / "t.jsonl"))
    assert "cannot parse" in str(e.value) and "as JSON Lines" in str(e.value)
    assert "orient='records', lines=True" in e.value.hint


def _partitioned(tmp_path):
    """A table written as Spark and pandas write one: a folder of hive partitions, with a _SUCCESS
    marker, and the same rows as one file."""
    d = _table(90).assign(day=np.repeat(["d1", "d2", "d3"], 30))
    d.to_parquet(tmp_path / "parts", partition_cols=["day"])
    (tmp_path / "parts" / "_SUCCESS").write_text("")
    return d


def test_a_directory_of_parquet_partitions_is_read_as_one_table(tmp_path):
    d = _partitioned(tmp_path)
    (tmp_path / "parts" / "notes").mkdir()  # a folder that is no partition is not read
    (tmp_path / "parts" / "notes" / "old.parquet").write_bytes(b"not parquet")
    table = load_table(str(tmp_path / "parts"))
    pd.testing.assert_frame_equal(table, d[table.columns.tolist()])
    assert table["day"].tolist() == d["day"].tolist()  # the partition is a column again
    meta = prepare_data(PrepareSpec(str(tmp_path / "parts"), str(tmp_path / "o"), feature_columns=("a", "b", "c", "d")))
    assert sum(meta["rows"].values()) == 90 and meta["classes"] == [0, 1, 2]
    with pytest.raises(DatasetError, match="column 'day': must be numeric, got text"):  # told to choose features
        prepare_data(PrepareSpec(str(tmp_path / "parts"), str(tmp_path / "o2")))


def test_an_s3_prefix_of_parquet_partitions_is_read_as_one_table(s3, bucket, tmp_path):
    d = _partitioned(tmp_path)
    s3.upload_dir(tmp_path / "parts", f"s3://{bucket}/exports/table")
    s3.write_bytes(f"s3://{bucket}/exports/table.csv", b"a,label\n")  # a neighbour sharing the prefix's name
    for uri in (f"s3://{bucket}/exports/table/", f"minio://{bucket}/exports/table"):
        table = load_table(uri, s3)
        pd.testing.assert_frame_equal(table, d[table.columns.tolist()])
    meta = prepare_data(PrepareSpec(f"s3://{bucket}/exports/table/", f"s3://{bucket}/prepared-parts",
                                    feature_columns=("a", "b", "c", "d")), s3)
    assert sum(meta["rows"].values()) == 90
    with pytest.raises(DatasetError, match="dataset not found"):
        load_table(f"s3://{bucket}/exports/none/", s3)


def test_a_folder_or_workbook_that_is_no_table_says_what_to_give(tmp_path):
    (tmp_path / "csvs").mkdir()
    _table().to_csv(tmp_path / "csvs" / "part-0.csv", index=False)
    with pytest.raises(DatasetError, match="is a directory without Parquet files") as e:
        load_table(str(tmp_path / "csvs"))
    assert "a directory of .parquet files" in e.value.hint
    (tmp_path / "t.xlsx").write_bytes(b"PK\x03\x04")
    with pytest.raises(DatasetError, match=r"is a spreadsheet workbook \(.xlsx\)") as e:
        load_table(str(tmp_path / "t.xlsx"))
    assert "save the sheet as CSV" in e.value.hint


@pytest.mark.parametrize("column, kind", [
    (pd.date_range("2026-01-01", periods=60, tz="UTC"), "dates and times"),
    (pd.date_range("2026-01-01", periods=60), "dates and times"),
    (pd.to_timedelta(np.arange(60), unit="s"), "durations"),
])
def test_a_typed_date_or_duration_column_is_no_feature(tmp_path, column, kind):
    # Parquet keeps them typed; read as a number a date was its nanoseconds (1.7e18), trained on silently
    _table().assign(when=column).to_parquet(tmp_path / "t.parquet")
    with pytest.raises(DatasetError, match=f"column 'when': holds {kind}, not numbers; leave it out"):
        prepare_data(PrepareSpec(str(tmp_path / "t.parquet"), str(tmp_path / "o")))
    with pytest.raises(DatasetError, match=f"column 'when': holds {kind}, not numbers; give it as numbers"):
        prepare_data(PrepareSpec(str(tmp_path / "t.parquet"), str(tmp_path / "o"), feature_columns=("a", "when")))
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.parquet"), str(tmp_path / "o"), feature_columns=("a", "b")))
    assert meta["features"] == ["a", "b"]


@pytest.mark.parametrize("encoding, expect", [
    ("cp1252", "semicolon-separated, decimal commas, cp1252-encoded"),  # Excel's plain "CSV" in a German locale
    ("utf-8-sig", "semicolon-separated, decimal commas"),  # Excel's "CSV UTF-8": a BOM first
])
def test_a_spreadsheets_csv_export_is_read_in_its_encoding(tmp_path, encoding, expect):
    d = _table().rename(columns={"a": "größe"}).assign(label=lambda t: t["label"].map({0: "Äpfel", 1: "Birne", 2: "Café"}))
    d.to_csv(tmp_path / "t.csv", index=False, sep=";", decimal=",", encoding=encoding)
    table = load_table(str(tmp_path / "t.csv"))
    pd.testing.assert_frame_equal(table, d)
    assert table.attrs["csv_format"] == expect
    meta = prepare_data(PrepareSpec(str(tmp_path / "t.csv"), str(tmp_path / "o")))
    assert meta["features"] == ["größe", "b", "c", "d"] and meta["class_names"] == ["Birne", "Café", "Äpfel"]
