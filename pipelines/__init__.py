"""Pipelines built from kfp-pytorch components, and the registry the CLI reads.

Each entry of :data:`PIPELINES` pairs a ``@dsl.pipeline`` function with a validator that checks
the typed parameters before any step runs (KFP itself checks types only at compile time).
"""
from .registry import PIPELINES, PipelineEntry, get_pipeline

__all__ = ["PIPELINES", "PipelineEntry", "get_pipeline"]
