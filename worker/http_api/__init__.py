"""The OpenAI-compatible HTTP face of a worker (``kvcoord worker --http-listen``): request
parsing and validation shared with the gateway (``openai_requests``), the answers and stream
chunks (``openai_responses``), and the aiohttp server (``server``)."""
