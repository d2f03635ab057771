"""``kvcoord gateway``: an OpenAI-compatible front door that routes each request by the global
prefix index (``server``), configured like every other command (``config``)."""
