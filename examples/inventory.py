def restock(inventory, orders, threshold):
    report = []
    for item, count in inventory.items():
        if count < threshold:
            needed = threshold - count
            orders[item] = orders.get(item, 0) + needed
            report.append(item + ": ordered " + str(needed))
        else:
            report.append(item + ": ok")
    return report
