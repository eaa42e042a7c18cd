"""A pytest plugin that records every chi-square p-value the exactness tests compute, one JSON line per value
(``{"test": nodeid, "p": ...}``) appended to ``$PVREC_OUT`` (default ``pvalues.jsonl``); it changes nothing else.

  PYTHONPATH=scripts:. python -m pytest -q -p pvrec tests/test_engine.py tests/test_drawn.py tests/test_kernels.py \
      tests/test_generation_options.py tests/test_llama.py tests/test_reflex.py tests/test_smollm.py \
      tests/test_attention.py
"""

import json
import os
import sys

_running = {"test": None}


def pytest_runtest_setup(item):
    _running["test"] = item.nodeid


def pytest_collection_modifyitems(session, config, items):
    module = sys.modules.get("tests.test_engine")  # every test's chi-square goes through its ``chisquare``
    if module is None:
        return
    chisquare, out = module.chisquare, os.environ.get("PVREC_OUT", "pvalues.jsonl")

    def recorded(*args, **kwargs):
        result = chisquare(*args, **kwargs)
        with open(out, "a") as f:
            f.write(json.dumps({"test": _running["test"], "p": float(result.pvalue)}) + "\n")
        return result

    module.chisquare = recorded
