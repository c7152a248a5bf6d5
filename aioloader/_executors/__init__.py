"""Where decode (and collate) calls run: the executor contract, inline and threads, and process workers."""
