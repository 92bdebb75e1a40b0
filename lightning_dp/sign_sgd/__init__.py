"""DP-SignSGD's mechanism: each worker privatises the sign of its clipped sum, the workers vote (docs/sign_sgd.md).

The optimizers that step on the vote are :mod:`lightning_dp.optim.sign_sgd`; the private step reaches the release rule
here by its marker (``mechanism = "sign_vote"``).
"""
