"""The application built on embedcore's core: a command line that trains a NumPy DLRM on click logs.

``trainer`` runs the loop that ``run_config`` describes, over a dataset from ``data`` (synthetic,
MovieLens, CSV) with a head from ``models``, scoring with ``metrics`` and drawing with ``plot``;
``quickstart`` is TensorFlow's CustomOptimizer examples on a tiny regression; ``cli`` is the
``embedcore`` command. Only this package, the bench and the tests import it; the core never does.
"""
