"""The lab, apart from the library: the policy zoo, tasks and rewards, benchmarks, the ablation and the demo.

Nothing in ``engine``, ``adapt`` or the trainer imports this package.
"""
