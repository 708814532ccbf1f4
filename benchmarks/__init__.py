"""Measurements of jitted incremental decoding, reported as ratios within one run."""
