"""Admin: the RL control plane over HTTP, mounted only with `rollout serve --admin` (`Server(admin=True)`): pause,
sleep, weight updates, under vLLM's (and SGLang's) endpoint names.

Files: `routes.py` (the routes under vLLM's names, the key they need beyond loopback, and `Control`: each operation
on the rollout side), `sglang.py` (SGLang's names and bodies for the same operations, and AReaL's `/areal_*` ones),
`transfer.py` (where an update's tensors come from: a checkpoint directory, or a trainer's torch.distributed group),
`staging.py` (the /start_weight_update ... /finish_weight_update fence: chunks staged, applied as one update).
May import: torch, fastapi, `base` of rollout's folders and the server's `transport`; nothing of the serving APIs
(tests/test_layout.py checks it).
"""
