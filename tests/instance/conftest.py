import os
import sys

_here = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(_here, "..", "splitter"))  # tiny_models
sys.path.insert(0, os.path.join(_here, "..", "e2e"))  # hf_oracle
