"""Installs the fault matrix's write injector (tests/fault_inject.py) in a process a cell launched: put this folder
first on PYTHONPATH and set RAG_FAULT_INJECT (tests/fault_matrix.py does both for the cells that need it)."""

import os
import sys

if os.environ.get("RAG_FAULT_INJECT"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fault_inject

    fault_inject.install_from_env()
