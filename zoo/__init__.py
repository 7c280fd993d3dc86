"""alstm-zoo: adaptive-parameterization language models with pretrained checkpoints.

    import zoo
    zoo.list_models("alstm-*", dataset="ptb")   # catalogue names (shell-style patterns, as timm.list_models)
    model = zoo.load("default")
    model.score("The Dow rose 3.5% on Monday.")[0]["ppl"]
    print(model.generate("the stock market", max_new_tokens=20, seed=0))
"""

from zoo.catalog import list_models
from zoo.lm import LanguageModel
from zoo.version import __version__
from zoo.zoo_model import ZooModel, load

__all__ = ["LanguageModel", "ZooModel", "__version__", "list_models", "load"]
