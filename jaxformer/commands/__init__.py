"""The commands a user runs, each thin over the library: `jaxformer-generate`,
`jaxformer-serve`, `jaxformer-perplexity`, `jaxformer-finetune`, `jaxformer-report` and
`jaxformer-selfcheck` (also `python -m jaxformer.commands.<name>`).

The wing sits above the library: a command imports the library, never the reverse.
"""
