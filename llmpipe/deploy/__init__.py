"""Scale past one engine: data-parallel engine replicas on Ray Serve behind one OpenAI ingress (ray.py)."""
