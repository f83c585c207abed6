"""GeoFP8 geometry: K-FAC input statistics, the damped low-rank transform, selection and refresh."""

from .coordinates import GeoTransform
from .geo import GeoState, TransformMismatchError, select_parameters
from .stats import InputStats
from .transform import LowRankTransform, build_transform, identity_transform

__all__ = [
    "GeoState",
    "GeoTransform",
    "InputStats",
    "LowRankTransform",
    "TransformMismatchError",
    "build_transform",
    "identity_transform",
    "select_parameters",
]
