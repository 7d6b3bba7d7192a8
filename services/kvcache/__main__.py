"""`python -m services.kvcache [--ram-bytes N] [--ssd-bytes N] [--ssd-ttl-days D] [--capacity-bytes N] ...`"""

from services.kvcache import config
from services.kvcache.service import KvCacheService
from shared.service import main

if __name__ == "__main__":
    main("kvcache", lambda common, args: KvCacheService(config.from_args(common, args)), config.add_args)
