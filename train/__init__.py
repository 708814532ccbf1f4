"""The demos: `python -m train.reverse` (the 2017 encoder-decoder reverses sequences) and
`python -m train.lm` (the decoder-only model copies patterns or learns a text file).

Each demo module is a `jaxformer.training.runs.Demo`: a `Settings` dataclass whose defaults
are its command line's, `build(settings)` returning the model, parameters, optimizer and
batches ready for the library trainer (`jaxformer.training.runs`), a `snapshotter` for the
report page, the labels of its results (`RESULT_LABELS`), and `main(argv)`. `train.tasks`
holds their data, `train.attention_maps` what they draw in the terminal; `jaxformer-report`
rebuilds a run's page.
"""
