"""Datasets for embedcore: a synthetic Criteo-like click log with a known optimum, and readers for
MovieLens ratings and CSV click logs. Every dataset yields :class:`Batch` objects (see :mod:`.batch`)."""

from .batch import Batch, DataFormatError, FeatureSpec, feature_configs, rebatch
from .csv_log import CsvClickLog
from .movielens import MovieLens
from .synthetic import SyntheticClickLog

__all__ = ["Batch", "FeatureSpec", "DataFormatError", "feature_configs", "rebatch",
           "SyntheticClickLog", "MovieLens", "CsvClickLog"]
