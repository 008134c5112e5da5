"""fitgraph where people already train, one module per framework (each imports its framework
only when it is itself imported, so ``import fitgraph`` needs neither):

* ``fitgraph.integrations.huggingface``: ``FitgraphCallback``, a Hugging Face ``Trainer``
  callback that compiles the model with ``fitgraph.backend`` (``pip install fitgraph[hf]``).
* ``fitgraph.integrations.lightning``: PyTorch Lightning (``pip install fitgraph[lightning]``).
"""
