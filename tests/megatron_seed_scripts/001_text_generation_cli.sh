python tools/text_generation_cli.py 127.0.0.1:5000
