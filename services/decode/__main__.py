from shared.service import main
from shared.worker.config import add_worker_args, worker_config

from services.decode.service import DecodeService

if __name__ == "__main__":
    main("decode", lambda config, args: DecodeService(config, worker_config(args)), add_worker_args)
