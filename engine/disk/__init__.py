"""The disk tier: block files on local disk (``store.DiskStore``).  Nothing is imported here, so
the engine imports without the disk tier's dependencies (xxhash) unless a disk path is configured."""
