"""Runnable demos: `python -m train.reverse` (the 2017 encoder-decoder) arrives next."""
