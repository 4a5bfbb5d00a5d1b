"""Transport: what every HTTP route shares, whatever API it serves.

Files: `errors.py` (ApiError: OpenAI's error shape, raised anywhere a request fails; the app answers with it),
`limits.py` (RequestLimits: how much one request may ask, and the JSON body read within them). May import: `base`
of rollout's folders, nothing else of the server (the bottom of the server's layers: tests/test_layout.py checks it).
"""
