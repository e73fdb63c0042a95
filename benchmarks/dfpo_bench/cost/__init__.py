"""The jobs that time DFPO against TRL: the loss step, the micro-step parts, the whole loop, memory."""
