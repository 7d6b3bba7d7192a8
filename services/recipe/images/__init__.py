"""V4.1 image input: sources, limits, the token specification and resolution (deepseek-recipe 0.2.0 is the
oracle, tests/oracle/test_image_oracle*.py). No image library is installed, so images are read down to their
header (format and size), never decoded: the encoded bytes travel to the worker with their target size."""
