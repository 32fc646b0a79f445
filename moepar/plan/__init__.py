"""Planning a run before any GPU is rented: closed-form memory per rank (memory.py)."""
