"""What goes in and comes out as text: the tokenizer (tokenizer.py) and the incremental detokenizer
(detokenizer.py), images (images.py, torch-free: producers check them; multimodal.py, the model's image
processing) and checkpoint loading (loader.py).
"""
