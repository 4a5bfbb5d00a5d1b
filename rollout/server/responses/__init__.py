"""The Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`): a turn runs as the chat request it
translates to, through the chat path's own parser and service.

Files: `turns.py` (Turn: a Responses request read as the chat request it runs as), `items.py` (Responses items and
tools in chat shapes, and back), `replies.py` (the response object and its streamed events), `store.py`
(ResponseStore: the responses kept for `previous_response_id`). May import: the server's `transport`, `rollouts` and
`completions`; never `admin` or the server's top modules (tests/test_layout.py checks it).
"""
