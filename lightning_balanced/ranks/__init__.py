"""What a multi-process run says about its ranks: rank-zero reports (``reports``) and why a rank stopped
(``stop_notices``, left in the process group's store so the others can name it)."""
