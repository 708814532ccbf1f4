"""The demos: `python -m train.reverse` (the 2017 encoder-decoder reverses sequences) and
`python -m train.lm` (the decoder-only model copies patterns or learns a text file).

Each demo module is a `train.cli.Demo`: a `Settings` dataclass whose defaults are its
command line's, `build(settings)` returning the model, parameters, optimizer and batches
ready for `jaxformer.training`, a `snapshotter` for the report page, and `main(argv)`.
`train.cli` is the skeleton they share, `train.tasks` their data, `train.report_page` and
`train.attention_maps` what they draw, `train.report` the command that rebuilds a run's
page.
"""
