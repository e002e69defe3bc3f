"""Small facts every stage shares, each with one owner: what an S3 URI is (uri), digests (digest,
crc), progress lines (progress)."""
