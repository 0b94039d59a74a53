"""Architecture and hyperparameter search over specs with Optuna (docs/search.md).

study = load_study("studies/quickstart.yaml")    # validated; StudyError lists every problem
summary = search(study, trials=12, workers=2)    # SQLite under runs/ unless storage= is given
"""

from miras.search.run import Summary, search
from miras.search.storage import SearchError, default_storage, open_storage, open_study
from miras.search.study import StudyDef, StudyError, load_study

__all__ = [
    "SearchError",
    "StudyDef",
    "StudyError",
    "Summary",
    "default_storage",
    "load_study",
    "open_storage",
    "open_study",
    "search",
]
