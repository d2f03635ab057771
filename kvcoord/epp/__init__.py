"""``kvcoord epp``: a Gateway API Inference Extension endpoint picker (Envoy ext_proc) that
routes through the coordinator with the gateway's own request reading and routing."""
