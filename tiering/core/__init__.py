"""The mechanism: page pools, the copy executors, page copies (CUDA streams or
threads), checksums, pinned host memory, staging buffers and clocks."""
