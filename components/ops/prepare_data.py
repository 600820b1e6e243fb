"""KFP component wrapper of :mod:`kfp_pytorch.components.prepare_data` (thin: parse inputs, call the runtime)."""
from kfp import dsl
from kfp.dsl import Dataset, Output

from .._kfp import COMPONENT_KW


@dsl.component(**COMPONENT_KW)
def prepare_data_op(dataset_uri: str, dataset: Output[Dataset], label_column: str = "label",
                    feature_columns: str = "", val_fraction: float = 0.15, test_fraction: float = 0.15, seed: int = 42,
                    shard_rows: int = 0, storage_root: str = ""):
    """Validate a table, split it (seeded, stratified), normalise and write shards. ``feature_columns``:
    comma-separated names (empty: every column but the label). ``shard_rows``: rows per shard (0:
    shards of about 16 MiB, read with one request each)."""
    import sys

    from kfp_pytorch.components._kfp import artifact_store_uri, mark_local_run
    from kfp_pytorch.components.prepare_data import PrepareSpec, duplicates_note, parse_columns, prepare_data

    mark_local_run(dataset)
    out = artifact_store_uri(dataset, storage_root)
    meta = prepare_data(PrepareSpec(dataset_uri=dataset_uri, output_uri=out, label_column=label_column,
                                    feature_columns=parse_columns(feature_columns), val_fraction=val_fraction, test_fraction=test_fraction, seed=seed,
                                    shard_rows=shard_rows))
    dataset.metadata.update({"uri": out, "rows": meta["rows"], "num_features": meta["num_features"],
                             "classes": meta["classes"], "split_seed": seed, "duplicates": meta["duplicates"]})
    if meta["source_format"]:  # what was inferred, said: a wrong guess would change the data
        dataset.metadata["source_format"] = meta["source_format"]
        shown = meta["features"][:8]
        print(f"read {dataset_uri} as {meta['source_format']}; features: {', '.join(shown)}"
              + (f" and {len(meta['features']) - len(shown)} more" if len(meta["features"]) > len(shown) else ""))
    if note := duplicates_note(meta["duplicates"], meta["rows"]):
        print(f"warning: {note}", file=sys.stderr)
