"""The demos: `python -m train.reverse` (the 2017 encoder-decoder reverses sequences) and
`python -m train.lm` (the decoder-only model copies patterns or learns a text file).

Each demo module has a `Settings` dataclass whose defaults are its command line's,
`build(settings)` returning the model, parameters, optimizer and batches ready for
`jaxformer.training`, and `main(argv)`. `train.cli` is the skeleton they share,
`train.tasks` their data.
"""
