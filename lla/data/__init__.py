"""Data pipeline: tokenizer, corpora, fixed-length passages and their seeded splits.

Entry points: `load_splits`, `load_tokenizer`, `pretraining_tokens`.
"""

from lla.data.corpora import ClinicalTemplates
from lla.data.corpora import Corpus
from lla.data.corpora import PythonStdlibCode
from lla.data.corpora import WikiText2
from lla.data.corpora import WikiText2Hub
from lla.data.load import get_config
from lla.data.load import load_splits
from lla.data.load import load_splits_from_config
from lla.data.load import load_tokenizer
from lla.data.load import make_corpus
from lla.data.load import pretraining_tokens
from lla.data.passages import Passages
from lla.data.passages import Splits
from lla.data.passages import token_sha256
from lla.data.paths import DataNotFoundError
from lla.data.paths import resolve_data_dir
from lla.data.tokenizer import Tokenizer
