from service.server import main

main()
