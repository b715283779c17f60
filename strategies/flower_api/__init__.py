"""The Flower adapters of the algorithm layer (``strategies.methods``): the only modules here that import flwr.

``strategy`` (``ClippedSGDStrategy``: FedAvg's contract driving a method's rounds;
``flower_strategy(method)``), the strategies with their own arguments (``celgc_strategy``,
``naive_strategy``, ``episode_strategy``), Messages to and from exchanges (``wire``), the
checks of every reply (``screen``), which connected nodes train (``node_sampling``) and the
client API for any ClientApp (``client_api``, public as ``strategies.clientapp``).
"""
